"""`greyhound report`'s text rendering of a post-mortem's causes."""

from __future__ import annotations

from greyhound.report_cli import _evidence_text


def test_evidence_line_names_workers_and_keeps_scalars():
    evidence = {
        "s_step_start": 1.02,
        "late_workers": [{"dp_rank": d, "pp_rank": 3, "node": f"n{d + 1}", "late_s": 0.005} for d in range(5)],
        "last_stage_vs_others_compute": {"forward": 1.333, "backward": 1.353},
        "curve": [0.1, 0.2],   # not workers: left to the JSON
    }
    assert _evidence_text(evidence) == (
        "s_step_start=1.02, "
        "late_workers=[dp_rank=0 pp_rank=3 node=n1 late_s=0.005; dp_rank=1 pp_rank=3 node=n2 late_s=0.005; "
        "dp_rank=2 pp_rank=3 node=n3 late_s=0.005; +2 more], "
        "last_stage_vs_others_compute=(forward=1.333 backward=1.353)"
    )


def test_evidence_without_anything_to_show_falls_back_to_json():
    assert _evidence_text({"curve": [0.1, 0.2]}) == '{"curve": [0.1, 0.2]}'
