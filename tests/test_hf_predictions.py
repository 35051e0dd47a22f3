"""Hugging Face models and Lightning's demo Transformer: a prediction equals a real CPU run of the same step.

GPT-2 (tied embeddings), Llama (grouped-query attention, rotary), BERT (masked LM) and a ViT, each with an
all-ones and a padded attention mask where it takes one, at ``32-true`` and ``bf16-mixed``, with and without
``gradient_checkpointing_enable()``; and ``lightning.pytorch.demos``' Transformer. The real runs are
``hf_check.py``'s, in a fresh process, less what that process held before training (the data set).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from conftest import assert_equals_the_real_run
from hf_models import SPECS, Spec, build_batch, build_module

from lightning_memtenants import predict

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def real_runs() -> dict[str, dict]:
    """One real one-step Trainer fit per spec on the CPU, in two fresh processes (one per core of CI's two), so
    that the tracker sees only them."""
    names = [spec.name for spec in SPECS]
    halves = [names[0::2], names[1::2]]
    command = [sys.executable, str(HERE / "hf_check.py")]
    procs = [
        subprocess.Popen([*command, *half], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for half in halves
    ]
    runs = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        runs += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {run["spec"]: run for run in runs}


@pytest.mark.parametrize("spec", SPECS, ids=[spec.name for spec in SPECS])
@pytest.mark.slow
def test_a_hugging_face_model_is_predicted_to_the_byte(real_runs: dict[str, dict], spec: Spec) -> None:
    real = real_runs[spec.name]
    predicted = predict(build_module(spec), build_batch(spec), precision=spec.precision)
    assert_equals_the_real_run(predicted, real)
    report = real["report"]
    # the activation-checkpointing note, in the prediction as in the callback's report
    ckpt = [n for n in predicted.notes if n.startswith("activation checkpointing")]
    assert ckpt == [n for n in report["notes"] if n.startswith("activation checkpointing")]
    assert bool(ckpt) == spec.ckpt
    # a real mask, all ones or padded, leaves nothing to assume about its values
    assert not [n for n in predicted.notes if "no values" in n]
