"""draw_kernel.py's kernels under Triton's interpreter: the token torch.multinomial's arithmetic picks from the same
random numbers, the log-probability log_softmax gives, over chunks, padding and masked scores; and the claim the
kernels rest on, that torch.multinomial draws one sample as argmax p / q with q from exponential_. The compiled
kernels are checked on CUDA in tests/gpu_cuda_test.py against torch.multinomial with the same seed."""

import pytest
import torch
from triton_interpreter import interpreted

from tes_grpo.sampling import token_sampling

pytest.importorskip("triton", reason="requirements-test.txt installs triton (its interpreter runs these on CPU)")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    global dk
    with interpreted("tes_grpo.sampling.draw_kernel") as module:
        dk = module
        yield


dk = None  # tes_grpo.sampling.draw_kernel, set by triton_interpreter


def scores_and_noise(rows, vocab, seed=0, spread=4.0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, vocab, generator=g) * spread
    noise = torch.empty(rows, vocab).exponential_(generator=g)
    return scores, noise


def torchs_pick(scores, noise):
    """The token torch.multinomial(softmax(scores), 1) draws from these random numbers, and its log_softmax."""
    chosen = (torch.softmax(scores.double(), -1) / noise.double()).argmax(-1)
    return chosen, torch.log_softmax(scores.double(), -1).gather(1, chosen[:, None]).squeeze(1)


# (rows, vocabulary, chunks, masked: every other column -inf in row 0 as a top-k warper leaves it, dtype)
CASES = [
    (3, 5000, 1, False, torch.float32),  # one chunk, the last block part vocabulary, part padding
    (3, 5000, 4, False, torch.float32),  # chunks of 1 block: the third part padding, the fourth empty
    (2, 9000, 2, True, torch.float32),  # masked scores (-inf) are never drawn and add nothing to the sum
    (1, 2048, 1, False, torch.float32),  # one row, one whole block
    (2, 6000, 3, False, torch.bfloat16),  # bf16 scores, widened; 3 chunks (not a power of two)
    (4, 300, 1, False, torch.float32),  # a vocabulary smaller than one block
]


@pytest.mark.parametrize("rows, vocab, chunks, masked, dtype", CASES)
def test_draw_picks_torchs_token_and_its_log_softmax(rows, vocab, chunks, masked, dtype):
    scores, noise = scores_and_noise(rows, vocab)
    if masked:
        scores[0, ::2] = float("-inf")
    scores = scores.to(dtype)
    chosen, logprob = dk.draw(scores, noise, chunks=chunks)
    expected, expected_logprob = torchs_pick(scores.float(), noise)
    assert chosen.dtype == torch.int64 and logprob.dtype == torch.float32
    assert torch.equal(chosen, expected)
    assert (logprob.double() - expected_logprob).abs().max() < 1e-5  # float32 sums of the exponentials
    if masked:
        assert chosen[0] % 2 == 1


def test_a_sharp_distribution_draws_its_favourite():
    # one score far above the rest: whatever the random numbers, its quotient wins, with log-probability ~0
    scores, noise = scores_and_noise(2, 5000, spread=1.0)
    scores[:, 4321] = 60.0
    chosen, logprob = dk.draw(scores, noise, chunks=4)
    assert chosen.tolist() == [4321, 4321] and logprob.abs().max() < 1e-6


# (vocabulary, block, chunks, columns of equal quotients, the column drawn): torch's argmax takes the first of equal
# maxima, so must each lane over its loop steps, the lanes of a chunk and the chunks
TIES = [
    (64, 16, 1, (3, 19), 3),  # one lane (3), loop steps 0 and 1: the lane keeps its first
    (64, 16, 1, (12, 5), 5),  # one loop step, lanes 12 and 5: the chunk takes the lower column
    (5000, 2048, 4, (70, 2500, 4999), 70),  # chunks 0, 1 and 2 of 4: the first chunk's
]


@pytest.mark.parametrize("vocab, block, chunks, tied, expected", TIES)
def test_equal_quotients_give_the_first_column(vocab, block, chunks, tied, expected):
    scores = torch.zeros(1, vocab)
    noise = torch.full((1, vocab), 4.0)
    noise[0, list(tied)] = 0.5
    chosen, _ = dk.draw(scores, noise, chunks=chunks, block=block)
    assert chosen.tolist() == [expected]


def test_large_scores_are_taken_relative_to_the_rows_largest():
    # exp of a score above ~88 overflows float32: the kernels subtract each row's largest score (from every block of
    # every chunk) first. Row 0: one score of 150 in the third block of its chunk, drawn with log-probability ~0;
    # row 1: every score shifted up by 120, the same token and log-probability as unshifted
    scores, noise = scores_and_noise(2, 5000)
    scores[0, 4500] = 150.0
    scores[1] += 120.0
    chosen, logprob = dk.draw(scores, noise, chunks=1)
    expected, expected_logprob = torchs_pick(scores, noise)
    assert torch.equal(chosen, expected) and chosen[0] == 4500
    assert (logprob.double() - expected_logprob).abs().max() < 1e-4  # float32 scores near 120 keep ~1e-5


def test_many_draws_follow_the_distribution():
    # the drawn frequencies of a 4-token distribution over 1,000 draws (rows), each from new random numbers, against
    # its probabilities (0.09, 0.24, 0.67, 0): 0.05 is over 3 standard deviations of a frequency
    scores = torch.tensor([[0.0, 1.0, 2.0, -30.0]]).expand(1000, 4).contiguous()
    noise = torch.empty(1000, 4).exponential_(generator=torch.Generator().manual_seed(3))
    chosen, _ = dk.draw(scores, noise, block=16)
    counts = torch.bincount(chosen, minlength=4).double() / 1000
    assert (counts - torch.softmax(scores[0].double(), 0)).abs().max() < 0.05 and counts[3] == 0


def test_bad_noise_is_refused():
    scores, noise = scores_and_noise(2, 100)
    with pytest.raises(ValueError, match="noise .* must be float32 of the scores' shape"):
        dk.draw(scores, noise[:, :50])


# (rows, vocabulary, multiprocessors, chunks)
CHUNKS = [
    (64, 201088, 132, 16),  # GRPO's 64 sequences on an H100 or H200: 528 programs wanted, 16 x 64 = 1,024
    (8, 201088, 132, 64),  # few rows: capped at MAX_CHUNKS
    (64, 3000, 132, 2),  # a small vocabulary: no more chunks than blocks
    (1000, 201088, 132, 1),  # many rows fill the GPU alone
]


@pytest.mark.parametrize("rows, vocab, processors, chunks", CHUNKS)
def test_chunks_for(rows, vocab, processors, chunks):
    assert dk.chunks_for(rows, vocab, processors) == chunks


def test_torchs_multinomial_draws_as_argmax_over_exponential_numbers():
    # what the kernels rest on, on the torch at hand (the CUDA test checks it on a GPU): one sample from
    # torch.multinomial is argmax p / q with q = empty_like(p).exponential_(), and leaves the generator where that does
    probs = torch.softmax(torch.randn(6, 3000, generator=torch.Generator().manual_seed(1)) * 3, -1)
    torch.manual_seed(5)
    drawn = torch.multinomial(probs, 1).squeeze(1)
    after = torch.get_rng_state()
    torch.manual_seed(5)
    assert torch.equal(drawn, (probs / torch.empty_like(probs).exponential_()).argmax(-1))
    assert torch.equal(after, torch.get_rng_state())


def test_cuda_scores_go_to_the_kernels_unless_torch_is_asked(monkeypatch):
    # token_sampling.draw's choice, without a GPU: scores that say they are on CUDA reach draw_kernel.draw,
    # kernel="torch" keeps torch's ops
    calls = []
    monkeypatch.setattr(dk, "draw", lambda scores: calls.append(scores) or (torch.tensor([1]), torch.tensor([-0.5])))
    on_cuda = type("CudaScores", (), {"is_cuda": True})()
    chosen, logprob = token_sampling.draw(on_cuda, True, True)
    assert calls == [on_cuda] and chosen.tolist() == [1] and logprob.tolist() == [-0.5]
    assert token_sampling.draw(on_cuda, True, False)[1] is None  # no log-probability asked: none returned
    token_sampling.draw(torch.zeros(2, 8), True, True, kernel="torch")
    token_sampling.draw(torch.zeros(2, 8), True, True)  # CPU scores: torch's ops whatever the kernel
    assert len(calls) == 2


def test_draw_refuses_an_unknown_kernel():
    with pytest.raises(ValueError, match="kernel must be one of"):
        token_sampling.draw(torch.zeros(1, 4), True, False, kernel="cuda")
