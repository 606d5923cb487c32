"""patch() on a tiny random-initialised model of every installed transformers family that
has a rotary module (tests/transformers_sweep.py builds and checks them).

Each family built is served exactly (its logits and every rotary module's output, called
with the position ids the model itself passed, equal the unpatched model's) or refused in
one line; none fails otherwise, and at least 95% of them are served. The counts are printed
(``-s``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch", reason="the conformance extra (make test installs it)")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

from transformers_sweep import Report, sweep  # noqa: E402

import posenc  # noqa: E402

SERVED_SHARE = 0.95


@pytest.fixture
def client(server: Any) -> Iterator[posenc.Client]:
    with posenc.Client(server.target) as client:
        yield client


def test_every_rotary_family_is_served_exactly_or_refused_in_one_line(
    client: posenc.Client,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report: Report = sweep(client)
    counts = report.counts()
    built = counts["served"] + counts["refused"] + counts["failed"]
    print(f"\ntransformers {transformers.__version__}: {counts} of {len(report.outcomes)} families")
    for outcome in report.outcomes:
        if outcome.status in ("refused", "failed") or "module frequencies" in outcome.detail:
            print(f"  {outcome.family}: {outcome.status}: {outcome.detail[:240]}")
    assert built >= 100, counts  # the sweep itself still builds most families
    assert not report.of("failed"), [(o.family, o.detail) for o in report.of("failed")]
    for outcome in report.of("refused"):
        assert "\n" not in outcome.detail, outcome
    assert counts["served"] >= SERVED_SHARE * built, counts
