"""Sampler and SamplingState: greedy, masks, top-k / top-p, seeded streams, stop checks."""

from __future__ import annotations

import pytest
import torch

from pdserve.core.sampler import Sampler, SamplingState, step_seed
from pdserve.core.sampling_params import SamplingParams

EOS = 3


def _state(num_generated: int = 0, eos: tuple[int, ...] = (EOS,), **kw: object) -> SamplingState:
    return SamplingState(SamplingParams(**kw), eos, num_generated)  # type: ignore[arg-type]


def _logits(batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g)  # [batch, vocab]


# --- SamplingState ---------------------------------------------------------------------------------


def test_stop_ids_include_eos_and_stop_token_ids() -> None:
    assert _state(eos=(3, 4), stop_token_ids=(7,)).stop_ids() == {3, 4, 7}


def test_ignore_eos_removes_eos_from_stop_ids() -> None:
    assert _state(eos=(3, 4), stop_token_ids=(7,), ignore_eos=True).stop_ids() == {7}


def test_check_stop_counts_and_returns_none_for_ordinary_token() -> None:
    s = _state(max_tokens=5)
    assert s.check_stop(1) is None
    assert s.num_generated == 1


def test_check_stop_on_eos_and_stop_token() -> None:
    assert _state(max_tokens=5).check_stop(EOS) == "stop"
    assert _state(max_tokens=5, stop_token_ids=(9,)).check_stop(9) == "stop"


def test_check_stop_ignore_eos_does_not_stop_on_eos() -> None:
    assert _state(max_tokens=5, ignore_eos=True).check_stop(EOS) is None


def test_check_stop_length_at_max_tokens() -> None:
    s = _state(max_tokens=3)
    assert [s.check_stop(1) for _ in range(3)] == [None, None, "length"]


def test_check_stop_stop_wins_over_length() -> None:
    s = _state(num_generated=2, max_tokens=3)
    assert s.check_stop(EOS) == "stop"


def test_check_stop_eos_ignored_below_min_tokens() -> None:
    s = _state(max_tokens=5, min_tokens=2)
    assert s.check_stop(EOS) is None  # num_generated 1 < 2
    assert s.check_stop(EOS) == "stop"  # num_generated 2 >= 2


def test_check_stop_length_applies_even_below_stop_window() -> None:
    s = _state(num_generated=2, max_tokens=3, min_tokens=3)
    assert s.check_stop(1) == "length"


# --- greedy ------------------------------------------------------------------------------------------


def test_greedy_equals_argmax() -> None:
    logits = _logits(6, 50)
    states = [_state(temperature=0.0) for _ in range(6)]
    out = Sampler(seed=0).sample(logits, states)
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(dim=-1))


def test_greedy_on_half_precision_logits() -> None:
    logits = _logits(4, 33).to(torch.bfloat16)
    states = [_state(temperature=0.0, min_tokens=1, eos=()) for _ in range(4)]
    assert torch.equal(Sampler(seed=0).sample(logits, states), logits.float().argmax(dim=-1))


def test_greedy_ties_pick_first_index() -> None:
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0]])
    assert Sampler(seed=0).sample(logits, [_state(temperature=0.0)]).tolist() == [1]


# --- min_tokens ---------------------------------------------------------------------------------------


def _favouring(tokens: list[int], vocab: int = 10) -> torch.Tensor:
    """[1, vocab] logits with tokens in decreasing preference, everything else far below."""
    logits = torch.full((1, vocab), -10.0)
    for rank, t in enumerate(tokens):
        logits[0, t] = 10.0 - rank
    return logits


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = _favouring([EOS, 7, 5])
    sampler = Sampler(seed=0)
    for n in (0, 1):
        s = _state(num_generated=n, temperature=0.0, min_tokens=2, stop_token_ids=(7,))
        assert sampler.sample(logits, [s]).tolist() == [5]
    s = _state(num_generated=2, temperature=0.0, min_tokens=2, stop_token_ids=(7,))
    assert sampler.sample(logits, [s]).tolist() == [EOS]


def test_min_tokens_masks_only_rows_below_it() -> None:
    logits = _favouring([EOS, 5]).repeat(2, 1)
    states = [_state(temperature=0.0, min_tokens=1), _state(temperature=0.0)]
    assert Sampler(seed=0).sample(logits, states).tolist() == [5, EOS]


def test_min_tokens_does_not_mask_eos_when_ignore_eos() -> None:
    logits = _favouring([EOS, 7, 5])
    s = _state(temperature=0.0, min_tokens=2, stop_token_ids=(7,), ignore_eos=True)
    assert Sampler(seed=0).sample(logits, [s]).tolist() == [EOS]


def test_min_tokens_masks_stop_ids_for_random_rows() -> None:
    logits = torch.zeros(1, 4)  # uniform over 4 tokens
    states = [_state(min_tokens=1, seed=i) for i in range(500)]
    out = Sampler(seed=0).sample(logits.repeat(500, 1), states)
    assert EOS not in out.tolist()


# --- top-k / top-p -----------------------------------------------------------------------------------


def test_top_k_1_equals_greedy_at_any_temperature() -> None:
    logits = _logits(8, 100)
    sampler = Sampler(seed=0)
    for temp in (0.1, 1.0, 5.0, 100.0):
        states = [_state(temperature=temp, top_k=1) for _ in range(8)]
        assert torch.equal(sampler.sample(logits, states), logits.argmax(dim=-1))


def test_tiny_top_p_equals_greedy() -> None:
    logits = _logits(8, 100)
    states = [_state(temperature=2.0, top_p=1e-6) for _ in range(8)]
    assert torch.equal(Sampler(seed=0).sample(logits, states), logits.argmax(dim=-1))


def test_top_k_never_leaves_the_top_k() -> None:
    vocab, k, draws = 20, 4, 4000
    logits = _logits(1, vocab, seed=1)
    allowed = set(logits[0].topk(k).indices.tolist())
    states = [_state(temperature=3.0, top_k=k) for _ in range(draws)]
    out = set(Sampler(seed=0).sample(logits.repeat(draws, 1), states).tolist())
    assert out == allowed


def test_top_k_at_least_vocab_is_off() -> None:
    vocab, draws = 6, 3000
    logits = torch.zeros(draws, vocab)
    states = [_state(top_k=vocab + 5) for _ in range(draws)]
    assert set(Sampler(seed=0).sample(logits, states).tolist()) == set(range(vocab))


def test_top_p_never_leaves_the_nucleus() -> None:
    # probs [0.05, 0.5, 0.15, 0.3]: top_p=0.7 keeps {1, 3} (0.5 < 0.7, 0.8 >= 0.7).
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    draws = 4000
    states = [_state(top_p=0.7) for _ in range(draws)]
    out = set(Sampler(seed=0).sample(probs.log().repeat(draws, 1), states).tolist())
    assert out == {1, 3}


def test_top_k_and_top_p_per_row() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    draws = 3000
    states = [_state(top_p=0.7), _state(top_k=3), _state()] * draws
    out = Sampler(seed=0).sample(probs.repeat(3 * draws, 1), states).view(draws, 3)
    assert set(out[:, 0].tolist()) == {1, 3}
    assert set(out[:, 1].tolist()) == {1, 2, 3}
    assert set(out[:, 2].tolist()) == {0, 1, 2, 3}


# --- seeded streams ----------------------------------------------------------------------------------


def test_step_seed_is_in_torch_range_and_depends_on_both_inputs() -> None:
    seeds = {step_seed(s, n) for s in (0, 1, 2**63 - 1) for n in range(20)}
    assert len(seeds) == 60
    assert all(0 <= x < 2**63 for x in seeds)


def test_seeded_row_same_token_alone_or_in_any_batch() -> None:
    vocab = 64
    row = _logits(1, vocab, seed=5)
    target = _state(num_generated=7, seed=1234, temperature=0.8, top_k=40)
    alone = Sampler(seed=0).sample(row, [target]).item()
    for pos in range(4):
        others = [_state(), _state(temperature=0.0), _state(seed=99, num_generated=7)]
        states = others[:pos] + [target] + others[pos:]
        batch = _logits(4, vocab, seed=6 + pos)
        batch[pos] = row[0]
        out = Sampler(seed=100 + pos).sample(batch, states)
        assert out[pos].item() == alone


def _stream(seed: int, start: int, steps: int = 50, vocab: int = 100) -> list[int]:
    sampler, logits, tokens = Sampler(seed=0), torch.zeros(1, vocab), []
    for n in range(start, start + steps):
        tokens.append(int(sampler.sample(logits, [_state(num_generated=n, seed=seed)]).item()))
    return tokens


def test_seeded_stream_is_reproducible_and_resumable() -> None:
    full = _stream(seed=42, start=0)
    assert _stream(seed=42, start=0) == full
    assert _stream(seed=42, start=20, steps=30) == full[20:]


def test_seeded_streams_differ_by_seed_and_by_step() -> None:
    base = _stream(seed=42, start=0)
    other_seed = _stream(seed=43, start=0)
    shifted = _stream(seed=42, start=1)
    assert sum(a != b for a, b in zip(base, other_seed, strict=True)) > 40
    assert sum(a != b for a, b in zip(base, shifted, strict=True)) > 40


def test_unseeded_rows_follow_sampler_seed() -> None:
    logits = torch.zeros(32, 100)
    states = [_state() for _ in range(32)]
    a, b, c = Sampler(seed=1), Sampler(seed=1), Sampler(seed=2)
    out_a = a.sample(logits, states)
    assert torch.equal(out_a, b.sample(logits, states))
    assert not torch.equal(out_a, c.sample(logits, states))
    assert not torch.equal(out_a, a.sample(logits, states))  # the shared generator advances


# --- distribution and purity ------------------------------------------------------------------------


def test_seeded_draws_match_softmax() -> None:
    draws = 20000
    logits = torch.tensor([[1.0, 0.0, 2.0, -1.0, 0.5]])
    states = [_state(seed=s) for s in range(draws)]
    out = Sampler(seed=0).sample(logits.repeat(draws, 1), states)
    freq = torch.bincount(out, minlength=5).float() / draws
    assert (freq - torch.softmax(logits[0], dim=-1)).abs().max().item() < 0.02


def test_unseeded_draws_match_tempered_softmax() -> None:
    draws = 20000
    logits = torch.tensor([[1.0, 0.0, 2.0, -1.0, 0.5]])
    out = Sampler(seed=0).sample(logits.repeat(draws, 1), [_state(temperature=2.0)] * draws)
    freq = torch.bincount(out, minlength=5).float() / draws
    assert (freq - torch.softmax(logits[0] / 2.0, dim=-1)).abs().max().item() < 0.02


def test_sample_does_not_modify_logits_or_states() -> None:
    logits = _logits(4, 30)
    before = logits.clone()
    states = [
        _state(min_tokens=2, temperature=0.0),
        _state(min_tokens=2, top_k=5, top_p=0.5),
        _state(seed=3, top_p=0.9),
        _state(temperature=0.7),
    ]
    snapshot = [(s.params, s.eos_token_ids, s.num_generated) for s in states]
    Sampler(seed=0).sample(logits, states)
    assert torch.equal(logits, before)
    assert [(s.params, s.eos_token_ids, s.num_generated) for s in states] == snapshot


def test_rejects_batch_size_mismatch() -> None:
    with pytest.raises(ValueError, match="batch=2"):
        Sampler(seed=0).sample(torch.zeros(3, 5), [_state(), _state()])
