"""The router end to end with fake workers (pyzmq + core.messages, no torch): ordering, text, usage, errors,
cancellation, worker loss, health, reflection, and the `python -m router` process itself."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest
import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.core.messages import (
    AbortCmd,
    DecodeWorkerLostCmd,
    GenerateCmd,
    pack_token_ids,
)
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.router import client
from pdserve.router.config import RouterConfig
from pdserve.router.load_table import RESERVED_AT_DECODE, SharedLoads
from pdserve.router.server import RouterServer
from pdserve.router.tokenizer import RouterTokenizer
from tests.router_fakes import HEARTBEAT_TIMEOUT, FakeDecode, FakePrefill, Script, eventually, router_with_fakes

ROOT = Path(__file__).resolve().parents[2]
OUTPUT_TEXT = "Hello 👋🏽 wörld! 日本語 — done."


def test_stream_has_tokens_in_order_with_text_usage_and_finish(
    smollm2_dir: Path, run_dir: Path, tokenizer: RouterTokenizer
) -> None:
    tokens = tokenizer.encode(OUTPUT_TEXT)
    prompt = tokenizer.encode("Say hello")

    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script(tokens, num_cached_tokens=3)) as h:
            sampling = pb.SamplingParams(temperature=0.0, max_tokens=len(tokens), seed=5)
            got = await h.generate(pb.GenerateRequest(text="Say hello", sampling=sampling, request_id="req-1"))
            (cmd,) = h.prefill.got(GenerateCmd, "req-1")
            assert isinstance(cmd, GenerateCmd)
            assert cmd.token_ids == pack_token_ids(prompt) and cmd.decode_worker == 0 and cmd.timings.arrival > 0
            assert (cmd.sampling.temperature, cmd.sampling.max_tokens, cmd.sampling.seed) == (0.0, len(tokens), 5)
            # NOTE: events that arrive together leave together (one response), so count tokens, not responses
            assert [t for r in got for t in r.token_ids] == tokens and all(r.token_ids for r in got)
            assert "".join(r.text for r in got) == OUTPUT_TEXT
            assert not any("\ufffd" in r.text for r in got)
            last = got[-1]
            assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.request_id == "req-1"
            assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_prompt_tokens) == (
                len(prompt), len(tokens), 3,
            )  # fmt: skip
            assert last.timings.prefill_ms == pytest.approx(2.0, abs=0.01) and last.timings.first_token_ms >= 3.0
            assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in got[:-1])
            assert not h.decode.got(AbortCmd, "req-1")  # the worker finished on its own
            assert len(h.router.hub.table) == 0

    asyncio.run(body())


def test_bad_input_is_invalid_argument_and_reaches_no_worker(smollm2_dir: Path, run_dir: Path) -> None:
    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script([5])) as h:
            bad = [
                pb.GenerateRequest(),
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 49152])),
                pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0.0)),
                pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=0)),
            ]
            for request, needle in zip(bad, ["empty", "vocabulary", "top_p", "max_tokens"], strict=True):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await h.generate(request)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert needle in (err.value.details() or "")
            assert not h.prefill.got(GenerateCmd)

    asyncio.run(body())


def test_stop_string_finishes_with_stop_and_aborts_the_workers(
    smollm2_dir: Path, run_dir: Path, tokenizer: RouterTokenizer
) -> None:
    tokens = tokenizer.encode("one two\n\nUser: three four five")

    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script(tokens)) as h:
            sampling = pb.SamplingParams(stop=["\n\nUser:"])
            got = await h.generate(pb.GenerateRequest(text="count", sampling=sampling, request_id="s"))
            assert "".join(r.text for r in got) == "one two"
            assert got[-1].finish_reason == pb.FINISH_REASON_STOP
            assert got[-1].usage.completion_tokens == sum(len(r.token_ids) for r in got) < len(tokens)
            await eventually(lambda: bool(h.prefill.got(AbortCmd, "s") and h.decode.got(AbortCmd, "s")))

    asyncio.run(body())


def test_client_cancel_sends_abort_to_both_workers(smollm2_dir: Path, run_dir: Path) -> None:
    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script(list(range(100, 140)), decode_stall_after=3)) as h:
            call = h.stub.Generate(pb.GenerateRequest(text="go", request_id="c"))
            # NOTE: cancel on the first response: the decode worker's tokens may all arrive before the stream
            # wakes and go out merged with the first one, and the stalled decode worker sends no more.
            async for _ in call:
                call.cancel()
                break
            await eventually(lambda: bool(h.prefill.got(AbortCmd, "c") and h.decode.got(AbortCmd, "c")))
            await eventually(lambda: len(h.router.hub.table) == 0)

    asyncio.run(body())


def test_silent_decode_worker_fails_its_streams_unavailable_within_the_timeout(
    smollm2_dir: Path, run_dir: Path
) -> None:
    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script(list(range(100, 140)), decode_stall_after=2)) as h:
            calls = [h.stub.Generate(pb.GenerateRequest(text=f"go {i}", request_id=f"d{i}")) for i in range(3)]
            for call in calls:
                await call.read()
            h.decode.heartbeating = False
            silent_at = time.monotonic()
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "decode worker 0" in (
                    err.value.details() or ""
                )
            assert time.monotonic() - silent_at < HEARTBEAT_TIMEOUT + 0.5
            await eventually(lambda: h.prefill.got(DecodeWorkerLostCmd) == [DecodeWorkerLostCmd(0)])  # async
            assert await h.health() == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.generate(pb.GenerateRequest(text="again"))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            h.decode.heartbeating = True
            await asyncio.wait_for(h.router.wait_ready(), 2.0)
            await eventually(lambda: len(h.router.hub.table) == 0)

    asyncio.run(body())


def test_restarted_prefill_worker_fails_requests_waiting_for_their_first_token(
    smollm2_dir: Path, run_dir: Path
) -> None:
    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script([7, 8], prefill_stall=True)) as h:
            call = h.stub.Generate(pb.GenerateRequest(text="wait", request_id="p"))
            await eventually(lambda: bool(h.prefill.got(GenerateCmd, "p")))
            h.prefill.incarnation = uuid.uuid4().hex  # what a restarted process looks like
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "prefill worker 0 restarted" in str(
                err.value.details()
            )
            assert not h.prefill.got(DecodeWorkerLostCmd)

    asyncio.run(body())


def test_restarted_prefill_worker_with_migration_gets_the_request_again(smollm2_dir: Path, run_dir: Path) -> None:
    tokens = list(range(100, 110))

    async def body() -> None:
        script = Script(tokens, prefill_stall=True)
        async with router_with_fakes(smollm2_dir, run_dir, script, max_migrations=1) as h:
            sampling = pb.SamplingParams(temperature=0.0, max_tokens=len(tokens))
            call = h.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=sampling,
                                                      request_id="p"))  # fmt: skip
            await eventually(lambda: bool(h.prefill.got(GenerateCmd, "p")))
            script.prefill_stall = False
            h.prefill.incarnation = uuid.uuid4().hex  # what a restarted process looks like
            got = [r async for r in call]
            (cmd,) = h.prefill.got(GenerateCmd, "p#migrated-1")
            assert (
                isinstance(cmd, GenerateCmd)
                and cmd.token_ids == pack_token_ids([1, 2, 3])
                and cmd.sampling.num_generated == 0
            )
            assert [t for r in got for t in r.token_ids] == tokens and got[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert h.prefill.got(AbortCmd, "p")  # the lost attempt, in case the worker still has it
            assert h.router.hub.num_migrations == 1 and len(h.router.hub.table) == 0

    asyncio.run(body())


def test_lost_decode_worker_with_migration_resumes_with_the_tokens_so_far(smollm2_dir: Path, run_dir: Path) -> None:
    tokens = list(range(200, 216))

    async def body() -> None:
        script = Script(tokens, decode_stall_after=5)
        async with router_with_fakes(smollm2_dir, run_dir, script, max_migrations=2) as h:
            sampling = pb.SamplingParams(temperature=0.0, max_tokens=len(tokens), seed=3)
            call = h.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=sampling,
                                                      request_id="d"))  # fmt: skip
            seen: list[int] = []
            while len(seen) < 6:  # token 0 from prefill, 1..5 from decode
                seen += (await call.read()).token_ids
            script.decode_stall_after = None
            h.decode.heartbeating = False  # silent: down after the heartbeat timeout ...
            await asyncio.sleep(HEARTBEAT_TIMEOUT + 0.3)
            h.decode.incarnation = uuid.uuid4().hex  # ... and back as a new process
            h.decode.heartbeating = True
            while (r := await call.read()) is not grpc.aio.EOF:
                seen += r.token_ids
            got = seen
            assert got == tokens  # nothing lost, nothing twice
            (cmd,) = h.prefill.got(GenerateCmd, "d#migrated-1")
            assert isinstance(cmd, GenerateCmd)
            assert cmd.token_ids == pack_token_ids([1, 2, 3, *tokens[:6]]) and cmd.sampling.num_generated == 6
            assert (cmd.sampling.max_tokens, cmd.sampling.seed) == (len(tokens), 3)
            assert h.router.hub.num_migrations == 1 and len(h.router.hub.table) == 0

    asyncio.run(body())


def test_migration_gives_up_after_max_migrations(smollm2_dir: Path, run_dir: Path) -> None:
    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script([7, 8], prefill_stall=True), max_migrations=1) as h:
            call = h.stub.Generate(pb.GenerateRequest(text="wait", request_id="g"))
            for attempt_id in ("g", "g#migrated-1"):
                await eventually(lambda a=attempt_id: bool(h.prefill.got(GenerateCmd, a)))  # type: ignore[misc]
                h.prefill.incarnation = uuid.uuid4().hex
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "restarted" in str(err.value.details())
            assert h.router.hub.num_migrations == 1

    asyncio.run(body())


def test_admission_queues_what_has_no_kv_room_and_refuses_past_max_queued(smollm2_dir: Path, run_dir: Path) -> None:
    # the fake decode worker reports 128 blocks of 16 tokens; each request needs 2 + 1006 tokens: 63 blocks
    script = Script(list(range(100, 140)), decode_stall_after=2)

    def request(rid: str) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams(max_tokens=1006), request_id=rid
        )

    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, script, block_size=16, max_queued=1) as h:
            running = [h.stub.Generate(request(rid)) for rid in ("a", "b")]
            for call in running:
                await call.read()
            queued = h.stub.Generate(request("c"))
            await eventually(lambda: len(h.router.hub.admission) == 1)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.generate(request("d"))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "waiting for KV room" in str(
                err.value.details()
            )
            assert not h.prefill.got(GenerateCmd, "c") and not h.prefill.got(GenerateCmd, "d")
            assert h.router.hub.table.reserved_at_decode[0] == 126
            running[0].cancel()  # its 63 blocks are room for c
            assert (await queued.read()).token_ids[0] == 100
            assert h.prefill.got(GenerateCmd, "c") and len(h.router.hub.admission) == 0
            # a queued request that is cancelled leaves the queue and passes its turn on
            gone = h.stub.Generate(request("e"))
            await eventually(lambda: len(h.router.hub.admission) == 1)
            gone.cancel()
            await eventually(lambda: len(h.router.hub.admission) == 0)
            waits = h.stub.Generate(request("f"))
            await eventually(lambda: len(h.router.hub.admission) == 1)
            running[1].cancel()
            assert (await waits.read()).token_ids[0] == 100
            assert not h.prefill.got(GenerateCmd, "e")
            for call in (queued, waits):
                call.cancel()
            await eventually(lambda: len(h.router.hub.table) == 0 and +h.router.hub.table.reserved_at_decode == {})

    asyncio.run(body())


def test_a_front_end_admits_once_another_front_end_frees_the_kv_room(smollm2_dir: Path, run_dir: Path) -> None:
    # front end 0 of 2 (this router); front end 1's row of the shared load table holds all but 10 of the fake decode
    # worker's 128 blocks; a request needing 63 waits until front end 1's requests end (its row drops to 0)
    script = Script(list(range(100, 104)))
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams(max_tokens=1006))

    async def body() -> None:
        other = SharedLoads.open(run_dir, 2, 1, 1, 1)
        other.write(RESERVED_AT_DECODE, 0, 118)
        async with router_with_fakes(smollm2_dir, run_dir, script, block_size=16, num_frontends=2) as h:
            call = asyncio.ensure_future(h.generate(request))
            await eventually(lambda: len(h.router.hub.admission) == 1)
            await asyncio.sleep(0.3)
            assert not h.prefill.got(GenerateCmd) and len(h.router.hub.admission) == 1
            other.write(RESERVED_AT_DECODE, 0, 0)
            responses = await asyncio.wait_for(call, 5.0)
            assert [t for r in responses for t in r.token_ids] == script.tokens
            (cmd,) = h.prefill.got(GenerateCmd)
            assert isinstance(cmd, GenerateCmd) and cmd.frontend == 0

    asyncio.run(body())


def test_worker_error_event_ends_the_stream_with_its_code(smollm2_dir: Path, run_dir: Path) -> None:
    script = Script([7], prefill_error=("RESOURCE_EXHAUSTED", "the prompt needs 99 KV blocks"))

    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, script) as h:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.generate(pb.GenerateRequest(text="x"))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.value.details() == "the prompt needs 99 KV blocks"

    asyncio.run(body())


def test_duplicate_in_flight_request_id_is_already_exists(smollm2_dir: Path, run_dir: Path) -> None:
    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script([7, 8], prefill_stall=True)) as h:
            first = h.stub.Generate(pb.GenerateRequest(text="one", request_id="same"))
            await eventually(lambda: bool(h.prefill.got(GenerateCmd, "same")))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.generate(pb.GenerateRequest(text="two", request_id="same"))
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            first.cancel()

    asyncio.run(body())


def test_health_follows_worker_heartbeats_and_reflection_lists_the_service(smollm2_dir: Path, run_dir: Path) -> None:
    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script([7]), heartbeat=False) as h:
            assert await h.health() == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.generate(pb.GenerateRequest(text="x"))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            h.prefill.heartbeating = h.decode.heartbeating = True
            await asyncio.wait_for(h.router.wait_ready(), 2.0)
            await eventually(lambda: True)
            assert await h.health() == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(h.channel)
            call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            reply = await call.read()
            names = {s.name for s in reply.list_services_response.service}
            assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= names

    asyncio.run(body())


def test_get_model_info_reports_the_model(smollm2_dir: Path, run_dir: Path) -> None:
    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script([7])) as h:
            info = await h.stub.GetModelInfo(pb.GetModelInfoRequest())
            assert (info.model_name, info.vocab_size, info.max_model_len) == ("SmolLM2-135M-Instruct", 49152, 8192)
            assert list(info.eos_token_ids) == [2] and not info.HasField("block_size")

    asyncio.run(body())


def test_client_streams_text_to_stdout_and_usage_to_stderr(
    smollm2_dir: Path, run_dir: Path, tokenizer: RouterTokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = tokenizer.encode(OUTPUT_TEXT)

    async def body() -> int:
        async with router_with_fakes(smollm2_dir, run_dir, Script(tokens, finish_reason="stop")) as h:
            argv = ["--address", h.router.address, "--chat", "--max-tokens", "64", "--temperature", "0", "Hi"]
            code = await asyncio.to_thread(client.main, argv)
            (cmd,) = h.prefill.got(GenerateCmd)
            assert isinstance(cmd, GenerateCmd) and cmd.sampling.temperature == 0.0 and cmd.sampling.max_tokens == 64
            assert cmd.token_ids == pack_token_ids(tokenizer.encode_chat([{"role": "user", "content": "Hi"}]))
            return code

    assert asyncio.run(body()) == 0
    out, err = capsys.readouterr()
    assert out == OUTPUT_TEXT + "\n"
    assert err.startswith("[stop] prompt") and f"completion {len(tokens)} tokens" in err


def test_router_process_prints_ready_line_serves_and_stops_on_sigterm(
    smollm2_dir: Path, run_dir: Path, tokenizer: RouterTokenizer
) -> None:
    tokens = tokenizer.encode(" fine, thanks")

    async def body() -> None:
        ctx = zmq.asyncio.Context()
        prefill, decode_ = FakePrefill(0, run_dir, ctx, Script(tokens)), FakeDecode(0, run_dir, ctx, Script(tokens))
        prefill.decode = [decode_]
        argv = ["-m", "router", "--model", str(smollm2_dir), "--run-dir", str(run_dir), "--port", "0"]
        argv += ["--prefill", "1", "--decode", "1", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)]
        proc = await asyncio.create_subprocess_exec(sys.executable, *argv, cwd=ROOT, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        try:
            for fake in (prefill, decode_):
                fake.heartbeating = True
                fake.start()
            line = (await asyncio.wait_for(proc.stdout.readline(), 10.0)).decode()
            assert line.startswith("pdserve router ready on 127.0.0.1:") and " (HTTP http://127.0.0.1:" in line
            address = line.split()[4]
            async with grpc.aio.insecure_channel(address) as channel:
                got = [
                    r async for r in pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(text="how are you"))
                ]
            assert "".join(r.text for r in got) == " fine, thanks"
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 10.0) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            prefill.close()
            decode_.close()
            ctx.destroy(linger=0)

    asyncio.run(body())


def test_router_modules_do_not_import_torch() -> None:
    code = (
        "import pkgutil, importlib, sys, pdserve.router as router\n"
        "for m in pkgutil.iter_modules(router.__path__): importlib.import_module(f'pdserve.router.{m.name}')\n"
        "bad = sorted(n for n in ('torch', 'transformers') if n in sys.modules)\n"
        "assert not bad, bad\n"
        "print(len(list(pkgutil.iter_modules(router.__path__))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 10


def test_a_lone_router_keeps_its_grpc_port_and_front_ends_share_theirs(smollm2_dir: Path, run_dir: Path) -> None:
    async def body() -> None:
        async with router_with_fakes(smollm2_dir, run_dir, Script([7])) as h:
            (run_dir / "other").mkdir()
            other = RouterServer(RouterConfig(str(smollm2_dir), str(run_dir / "other"), port=h.router.port))
            with pytest.raises(RuntimeError, match="Failed to bind"):  # gRPC would share it by default (SO_REUSEPORT)
                await other.start()
            await other.stop(0)
        shared = RouterConfig(str(smollm2_dir), str(run_dir), port=0, num_frontends=2)
        first = RouterServer(shared)
        first.hub.serving.set()  # NOTE: listens once it serves; no workers here
        port = await first.start()
        second = RouterServer(dataclasses.replace(shared, port=port, frontend=1))
        second.hub.serving.set()
        try:
            assert await second.start() == port
        finally:
            await asyncio.gather(first.stop(0), second.stop(0))

    asyncio.run(body())
