"""The step's four verbs (engine.py): the runner only computes, the scheduler's `update`
applies; forks of an n > 1 request sample from their parent's logits row."""

from __future__ import annotations

from lmops.runtime.engine import LLMEngine, SamplingParams


def state(engine) -> list[tuple]:
    """Everything a step may change in the sequences and requests."""
    return [
        (s.num_computed_tokens, s.num_scored, s.prompt_nll, list(s.token_ids), list(s.block_table))
        for r in engine.requests.values()
        for s in r.seqs
    ] + [list(r.prompt_logprobs or []) for r in engine.requests.values()]


def test_the_runner_computes_and_update_applies(model_dir, prompts, all_blocks_free):
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", drift_sample=1.0)
    engine.add_request("scored", prompts[6], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))
    engine.add_request("plain", prompts[3], SamplingParams(temperature=0, max_tokens=3))
    batch = engine.scheduler.schedule()
    before = state(engine)
    output = engine.runner.execute(batch)
    assert state(engine) == before  # pure computation: nothing written into the sequences
    assert output.logits.shape == (2, engine.model_config.vocab_size)
    assert {score.seq.request.request_id for score in output.prompt_scores} == {"scored", "plain"}
    sampled = engine._sample(batch, output)
    update = engine.scheduler.update(batch, output.prompt_scores, sampled)
    assert state(engine) != before
    assert update.new_tokens == {"scored": 1, "plain": 1}
    scored = engine.requests["scored"]
    assert len(scored.prompt_logprobs) == len(prompts[6])  # None, then one entry per later token
    assert scored.seqs[0].prompt_nll > 0 and scored.seqs[0].num_scored == len(prompts[6]) - 1
    while engine.has_unfinished_requests():
        engine.step()
    all_blocks_free(engine)


def test_forks_sample_their_parents_row(model_dir, prompts, all_blocks_free):
    engine = LLMEngine.from_pretrained(model_dir, device="cpu")
    engine.add_request("n3", prompts[4], SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=4))
    batch = engine.scheduler.schedule()
    parent = batch.seqs[0]
    assert batch.samples[0] is parent and len(batch.samples) == 3 and batch.sample_rows == [0, 0, 0]
    assert all(child.block_table == parent.block_table for child in batch.samples[1:])
    assert engine.block_manager.blocks[parent.block_table[0]].ref_count == 3
    output = engine.runner.execute(batch)
    assert output.logits.shape[0] == 1  # one forward row for the three completions
    engine.scheduler.update(batch, output.prompt_scores, engine._sample(batch, output))
    assert [s.num_output_tokens for s in engine.requests["n3"].seqs] == [1, 1, 1]
    assert all(s.num_computed_tokens == len(prompts[4]) for s in engine.requests["n3"].seqs)
    while engine.has_unfinished_requests():
        engine.step()
    all_blocks_free(engine)
