"""End to end: the serving loop over the real cache generates the same tokens whether every
reused block came from GPU or went through host and disk first."""

from __future__ import annotations

import pytest

from models.chat_run import Budgets, identical_outputs, run_workload, token_match_rate
from models.config import preset
from models.model import PagedDecoder
from models.workloads import ChatWorkload, ChatWorkloadConfig, RagWorkload, RagWorkloadConfig
from tests.io_helpers import wait_quiet


@pytest.fixture(scope="module")
def model() -> PagedDecoder:
    return PagedDecoder(preset("tiny"), device="cpu")


def chat(model: PagedDecoder) -> ChatWorkload:
    return ChatWorkload(ChatWorkloadConfig(
        num_users=10, num_rounds=3, system_prompt_tokens=64, question_tokens=20,
        answer_tokens=10, arrival_rate=100.0, vocab_size=model.config.vocab_size, seed=3,
        ttl_seconds=300.0, retained_fraction=0.5,
    ))


TIGHT = Budgets(block_size=16, gpu_blocks=24, host_blocks=4, reserved_host_blocks=8,
                disk_blocks=2048)
ROOMY = Budgets(block_size=16, gpu_blocks=1024, host_blocks=0, reserved_host_blocks=0,
                disk_blocks=0)


def test_tokens_through_disk_are_identical_to_an_unlimited_gpu_pool(
    model: PagedDecoder,
) -> None:
    # Every disk hit is read (whatever the measured rates): the identity is through disk.
    # Each step's spills land before the next, so no block is dropped because the writers
    # fell behind on a loaded machine (the loop never waits for them): the tight run then
    # reuses every prefix the roomy one does, and both chunk every prompt the same way.
    tight = run_workload(model, chat(model), TIGHT, device="cpu",
                         cost_aware_onboarding=False, after_step=wait_quiet)
    roomy = run_workload(model, chat(model), ROOMY, device="cpu")
    stats = tight.cache.cache
    # The tight run really went through the disk tier...
    assert stats.onboards_completed > 0 and stats.spills_completed > 0
    assert sum(r.disk_tokens for r in tight.results) > 0
    assert roomy.cache.cache.onboards_completed == 0
    # ...reused the same prefixes (so both runs chunked every prompt the same way)...
    assert {r.request_id: r.gpu_tokens + r.host_tokens + r.disk_tokens
            for r in tight.results} == {r.request_id: r.gpu_tokens for r in roomy.results}
    # ...and generated exactly the same tokens.
    same, total = identical_outputs(tight, roomy)
    assert (same, total) == (30, 30)
    assert stats.io_errors == 0


def test_token_match_rate_against_recomputing_everything(model: PagedDecoder) -> None:
    # Every disk hit is read (whatever the measured rates): the identity is through disk.
    tight = run_workload(model, chat(model), TIGHT, device="cpu",
                         cost_aware_onboarding=False, after_step=wait_quiet)
    recompute = run_workload(model, chat(model), ROOMY, device="cpu", salt_every_request=True)
    assert sum(r.gpu_tokens + r.disk_tokens for r in recompute.results) == 0
    rate = token_match_rate(tight, recompute)
    print(f"token match rate vs no reuse: {rate:.3f}")
    assert rate >= 0.9


def test_rag_documents_served_from_disk_are_identical(model: PagedDecoder) -> None:
    def rag() -> RagWorkload:
        return RagWorkload(RagWorkloadConfig(
            num_documents=6, document_tokens=96, num_requests=24, question_tokens=12,
            answer_tokens=6, arrival_rate=200.0, vocab_size=model.config.vocab_size, seed=5,
        ))

    # As above: every disk hit read, whatever rates the machine's load gives the estimates
    # (with cost-aware onboarding a slow moment can recompute every one of them).
    tight = run_workload(model, rag(), TIGHT, device="cpu", cost_aware_onboarding=False,
                         after_step=wait_quiet)
    roomy = run_workload(model, rag(), ROOMY, device="cpu")
    assert tight.cache.cache.onboards_completed > 0
    same, total = identical_outputs(tight, roomy)
    assert same == total == 24
