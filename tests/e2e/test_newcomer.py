"""A newcomer's first command, as README.md writes it, on a fresh clone: `scripts/launch_cluster.sh` creates its
own .venv (no test extras: no triton, no grpcio-tools), converts the bundled SmolLM2 into an empty cache, serves,
answers a greedy chat request with transformers' tokens (over gRPC, and the same text over its HTTP door), and
stops every process on SIGTERM.

Nothing of this checkout's venv reaches the clone: no VIRTUAL_ENV, PYTHONPATH or venv on PATH."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from transformers import AutoTokenizer

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.hf_reference import hf_greedy

ROOT = Path(__file__).resolve().parents[2]
README_FIRST_COMMAND = "scripts/launch_cluster.sh"
READY = re.compile(r"pdserve cluster ready on (\S+) \(run dir (\S+)\), OpenAI-compatible HTTP on (\S+)")
SETUP_TIMEOUT_S = 900.0
"""Creating the venv and installing torch and transformers dominate; CI's machine may be slower than ours."""
STOP_TIMEOUT_S = 30.0
NEW_TOKENS = 16
QUESTION = "What is the capital of France?"


def test_readme_first_command_is_the_one_we_run() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    assert commands[0].strip() == README_FIRST_COMMAND


def fresh_env(tmp_path: Path) -> dict[str, str]:
    """This process's environment without its venv, with an empty pdserve cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    venv_bin = str(ROOT / ".venv" / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    env["PDSERVE_CACHE"] = str(tmp_path / "cache")
    return env


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("newcomer") / "pdserve"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(target)], check=True)
    return target


@pytest.fixture(scope="module")
def launched(clone: Path) -> Iterator[tuple[subprocess.Popen[str], str, Path, str]]:
    """The README's first command running in the clone: (process, gRPC address, run dir, HTTP base URL)."""
    env = fresh_env(clone.parent)
    start = time.monotonic()
    proc = subprocess.Popen(
        [README_FIRST_COMMAND], cwd=clone, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            ready = READY.search(line)
            if ready:
                break
            assert time.monotonic() - start < SETUP_TIMEOUT_S, "no ready line in time:\n" + "".join(lines[-40:])
        else:
            pytest.fail(f"exited ({proc.wait()}) before its ready line:\n" + "".join(lines[-40:]))
        elapsed = time.monotonic() - start
        print(f"README first command: ready after {elapsed:.1f} s on a fresh clone and venv")
        yield proc, ready.group(1), Path(ready.group(2)), ready.group(3)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def chat_request() -> pb.GenerateRequest:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=QUESTION)])
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return pb.GenerateRequest(chat=chat, sampling=sampling)


def test_first_command_serves_greedy_chat_like_transformers_and_stops_cleanly(
    launched: tuple[subprocess.Popen[str], str, Path, str], clone: Path
) -> None:
    proc, address, run_dir, http_url = launched
    with grpc.insecure_channel(address) as channel:
        responses = list(pb_grpc.GenerationStub(channel).Generate(chat_request(), timeout=120))
    got = [t for r in responses for t in r.token_ids]
    model_dir = clone.parent / "cache" / "models" / "SmolLM2-135M-Instruct"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    assert responses[-1].usage.prompt_tokens == len(prompt)
    assert got == hf_greedy(model_dir, [prompt], NEW_TOKENS)[0]
    reply = http_chat(http_url)  # NOTE: the HTTP door is on by default and answers with the same text
    assert reply["choices"][0]["message"]["content"] == "".join(r.text for r in responses)
    assert reply["usage"]["completion_tokens"] == NEW_TOKENS

    pids = [r["pid"] for r in json.loads((run_dir / "status.json").read_text())["roles"]]
    assert len(pids) == 3 and all(pids)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=STOP_TIMEOUT_S) == 0
    assert [pid for pid in pids if _alive(pid)] == [], "processes left after SIGTERM"
    assert list((clone / ".venv" / "lib").glob("python3*/site-packages/triton")) == [], "the test extras leaked in"


def http_chat(base_url: str) -> Any:
    """The same greedy chat through POST /v1/chat/completions (the standard library's HTTP client)."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
