"""Reading ``/metrics`` as Prometheus does: with its text-format parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def families(text: str) -> dict[str, object]:
    """Metric family name -> family, as the parser reads the exposition."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(text: str, sample: str, **labels: str) -> float | None:
    """The value of the sample ``sample`` with exactly these labels, or None."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and s.labels == labels:
                return float(s.value)
    return None


def sample_names(text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}
