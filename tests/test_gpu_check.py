"""``benchmarks/gpu_results.py``: the files ``make gpu-check`` leaves, made from a small results dict by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gpu_results import Results, difference, markdown

MiB = 2**20


def test_the_difference_is_predicted_minus_measured_in_mib_and_percent() -> None:
    assert difference(200 * MiB, 210 * MiB) == (10.0, 5.0)
    assert difference(250 * MiB, 240 * MiB) == (-10.0, -4.0)
    assert difference(0, MiB // 2) == (0.5, None)  # no percent of nothing
    assert difference(None, MiB) == (None, None)


def _results() -> dict:
    return {
        "device": "NVIDIA H200",
        "torch": "2.11.0+cu130",
        "target": "9.0",
        "budget_s": 420,
        "seconds": 181.4,
        "sections": {
            "models": {
                "seconds": 12.5,
                "status": "ok",
                "rows": {
                    "peak:gpt": {
                        "measured": {
                            "max_allocated_bytes": 200 * MiB,
                            "max_reserved_bytes": 250 * MiB,
                            "nvidia_smi_bytes": 770 * MiB,
                        },
                        "predicted": {"peak_bytes": 210 * MiB, "peak_reserved_bytes": 240 * MiB},
                    },
                    "peak:t5": {"error": "RuntimeError: child 'peak:t5': exit code 1\nTraceback ..."},
                },
            },
            "overhead": {"seconds": 0.0, "status": "skipped", "reason": "30 s of the budget left"},
            "expandable": {
                "seconds": 0.0,
                "status": "ok",
                "on_minus_off": {"gpt": {"measured_bytes": -18 * MiB, "predicted_bytes": -20 * MiB}},
            },
            "fits": {
                "seconds": 0.1,
                "status": "ok",
                "gpt2/bf16-mixed": [
                    {
                        "measured": {"peak_bytes": 1000 * MiB, "reserved_bytes": 1200 * MiB},
                        "predicted": {"peak_bytes": 1010 * MiB, "reserved_bytes": 1188 * MiB},
                    }
                ],
            },
            "sac": {
                "seconds": 0.0,
                "status": "ok",
                "rows": {
                    "peak:gpt-sac": {
                        "measured_forward_bytes": 64 * MiB,
                        "predicted_forward_bytes": 48 * MiB,
                        "predicted_activations_bytes": 40 * MiB,
                        "predicted_other_bytes": 8 * MiB,
                    }
                },
            },
        },
    }


def test_the_markdown_has_a_row_per_set_up_with_both_peaks_and_their_differences() -> None:
    text = markdown(_results())
    lines = text.splitlines()
    # 210 - 200 = +10 MiB, +5.0 %; 240 - 250 = -10 MiB, -4.0 %; nvidia-smi 770 MiB, no footprint predicted
    assert "| `peak:gpt` | 200.0 | 210.0 | +10.0 | +5.0% | 250.0 | 240.0 | -10.0 | -4.0% | 770.0 | - |" in lines
    # a set-up that failed keeps its row, empty, with the first line of its error
    assert "| `peak:t5` | - | - | - | - | - | - | - | - | - | - | RuntimeError: child 'peak:t5': exit code 1" in lines
    assert "| overhead | 0.0 | skipped: 30 s of the budget left |" in lines
    # SAC: 48 - 64 = -16 MiB, -25.0 %
    assert "| `peak:gpt-sac` | 64.0 | 48.0 | -16.0 | -25.0% | 40.0 | 8.0 |" in lines
    assert "| `gpt` | -18.0 | -20.0 |" in lines
    # 1010 - 1000 = +10 MiB, +1.0 %; 1188 - 1200 = -12 MiB, -1.0 %
    assert "| `gpt2/bf16-mixed` / 1 | 1000.0 | 1010.0 | +10.0 | +1.0% | 1200.0 | 1188.0 | -12.0 | -1.0% |" in lines
    assert lines[0] == "# gpu-check on NVIDIA H200"


def test_each_section_is_written_to_both_files_as_it_is_added(tmp_path: Path) -> None:
    results = Results(tmp_path / "out", 420.0, {"device": "NVIDIA H200", "smoke": False})
    assert json.loads((tmp_path / "out" / "results.json").read_text())["sections"] == {}
    section = _results()["sections"]["models"]
    results.add("models", section)
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written["sections"]["models"]["rows"]["peak:gpt"]["measured"]["max_allocated_bytes"] == 200 * MiB
    assert written["budget_s"] == 420.0 and written["device"] == "NVIDIA H200"
    assert "| `peak:gpt` | 200.0 | 210.0 |" in (tmp_path / "out" / "results.md").read_text()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["results.json", "results.md"]
