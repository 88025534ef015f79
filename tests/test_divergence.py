"""KL divergence and top-1 agreement against the float model (quantlab.eval.divergence): zero
for the model against itself, the direct full-vocabulary computation otherwise, and in the run
report next to perplexity."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from quantlab.eval.divergence import divergence
from quantlab.eval.perplexity import perplexity


def test_divergence_of_a_model_from_itself_is_zero():
    model = tiny_model("llama")
    stream = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(0))
    result = divergence(model, model, stream, seq_len=32)
    assert result.mean_kld == 0 and result.max_kld == 0 and result.top1_agreement == 1
    assert (result.windows, result.tokens_scored) == (3, 3 * 31)


def test_divergence_matches_the_direct_computation():
    reference = tiny_model("llama")
    candidate = copy.deepcopy(reference)
    with torch.no_grad():
        for p in candidate.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    stream = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(0))
    result = divergence(reference, candidate, stream, seq_len=32)
    with torch.no_grad():
        ids = stream.view(2, 32)
        ref = F.log_softmax(reference(ids).logits[:, :-1].double(), -1)
        cand = F.log_softmax(candidate(ids).logits[:, :-1].double(), -1)
    kld = F.kl_div(cand, ref, log_target=True, reduction="none").sum(-1).flatten()
    assert abs(result.mean_kld - float(kld.mean())) < 1e-5 * float(kld.mean()) + 1e-7
    assert result.max_kld >= result.p99_kld >= result.mean_kld > 0
    agree = float((ref.argmax(-1) == cand.argmax(-1)).double().mean())
    assert result.top1_agreement == agree < 1
    # the same pass gives the candidate's perplexity on the same windows
    assert result.candidate_mean_nll == pytest.approx(perplexity(candidate, stream, seq_len=32).mean_nll, rel=1e-5)
