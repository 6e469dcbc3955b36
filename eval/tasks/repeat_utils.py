"""Scoring for the repeated-sampling overlays: lm-eval's AIME scorer applied to every sample."""

from __future__ import annotations

from lm_eval.tasks.aime import utils as aime_utils


def aime_mean_over_samples(doc: dict, results: list) -> dict[str, float]:
    # With ``take_first_k`` the single result is the list of all k samples of this problem.
    samples = results[0] if results and isinstance(results[0], list) else results
    scores = [aime_utils.process_results(doc, [s])["exact_match"] for s in samples]
    return {"exact_match": sum(scores) / len(scores)}
