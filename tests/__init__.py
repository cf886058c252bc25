"""The test suite, by kind: ``unit`` (no servers, mirroring the packages),
``site`` (one site's real RabbitMQ and PostgreSQL), ``two_sites`` (two sites
and their nodes), ``fault`` (faults injected into two sites), ``interop``
(client libraries' own suites and other languages), ``docs`` (the README's
commands and the benchmark scripts); ``support`` holds what they share."""

from pathlib import Path

#: the checkout the suite runs from
REPO = Path(__file__).resolve().parent.parent
