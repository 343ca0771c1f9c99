"""The memory plan's margin as shipped (memory_plan.MARGIN_FRACTION of the room + MARGIN_GIB), against what it must
cover: in the capped GPU runs the logs record, what the CUDA allocator reserved above the weights beyond the plan's own
estimate. tests/test_memory_plan.py pins both constants to check the plan's logic; here they are the shipped ones.

A plan fills the room after the margin at most; the run then reserves the weights held, plus the estimate, plus what
the estimate leaves out and the allocator keeps unused (fragmentation, workspaces). That must stay within the
budget, so the margin must be at least the reserved peak less the weights held less the estimate."""

import pytest

from tes_grpo.training import memory_plan

GIB = 2**30

# (log under benchmarks/logs/, MEMORY_BUDGET_GB, GiB held after loading, the plan's largest estimate of a training
# pass or a generate call in GiB, the peak reserved GiB of the steps) as each log prints them. H100, torch 2.11, the
# allocator with expandable segments, gpt-oss-20b-shaped with resident MXFP4 experts.
MEASURED = [
    # 1,024 tokens, passes of 1 (TRAIN_BATCH_SIZE=1): "1 x 1,895 tokens ~ 2.2 GiB est."; reserved 15.7-15.8 GiB
    ("grpo-2026-11-27-1024-cap16-batch1-h100.log", 16.0, 13.1, 2.2, 15.77),
    # 4,000 tokens, passes of 4: "4 x 4,871 tokens ~ 9.0 GiB est." (the generate call: 8.2); reserved 23.4-23.5 GiB
    ("grpo-2026-11-27-4000-cap24-expandable-63fa68c-h100.log", 24.0, 13.1, 9.0, 23.52),
]


def margin_gib(budget: float, held: float) -> float:
    """The margin the plan takes off the room of a run with `budget` GiB holding `held` GiB (plenty free)."""
    facts = memory_plan.MemoryFacts(free_bytes=int(65.5 * GIB), held_bytes=int(held * GIB))
    budget_bytes = int(budget * GIB)
    return (memory_plan.room_before_margin(facts, budget_bytes) - memory_plan.room_bytes(facts, budget_bytes)) / GIB


@pytest.mark.parametrize("log, budget, held, estimate, reserved", MEASURED, ids=[m[0] for m in MEASURED])
def test_the_shipped_margin_covers_what_the_allocator_reserved_beyond_the_estimate(log, budget, held, estimate,
                                                                                   reserved):
    beyond = reserved - held - estimate
    margin = margin_gib(budget, held)
    assert margin >= beyond, (f"{log}: the margin ({memory_plan.MARGIN_FRACTION:.0%} of {budget - held:.1f} GiB + "
                              f"{memory_plan.MARGIN_GIB} GiB = {margin:.2f} GiB) is less than the {beyond:.2f} GiB the "
                              "allocator reserved beyond the estimate")


def test_the_margin_is_its_fraction_of_the_room_plus_its_fixed_part():
    # what the plan's messages quote ("the 10% + 0.5 GiB margin"), as room_bytes takes it off
    for budget, held in ((16.0, 13.1), (24.0, 13.1), (80.0, 20.0)):
        expected = memory_plan.MARGIN_FRACTION * (budget - held) + memory_plan.MARGIN_GIB
        assert margin_gib(budget, held) == pytest.approx(expected, abs=1e-6)
