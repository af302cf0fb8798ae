"""The token bucket a virtual link gets: large enough to reach the rate, small enough to shape.

(The clusters themselves, which need root and namespaces: tests/cluster/test_vcluster.py.)
"""

from __future__ import annotations

import pytest

from hpcdl.tools import vcluster


@pytest.mark.parametrize(("rate", "burst"), [("100mbit", 256 * 1024), ("1gbit", 256 * 1024),
                                             ("10gbit", 1_250_000), ("40gbit", 5_000_000)])
def test_the_bucket_holds_a_millisecond_of_the_rate_and_at_least_256_kib(
        rate: str, burst: int, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(vcluster, "_tc", calls.append)
    vcluster.tbf("eth0", rate, namespace="ns1")
    assert calls == [["-n", "ns1", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
                      "burst", str(burst), "latency", "20ms"]]


def test_a_malformed_rate_is_refused_before_tc_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vcluster, "_tc", lambda args: pytest.fail("tc ran"))
    with pytest.raises(vcluster.VClusterError, match="--rate must look like"):
        vcluster.tbf("eth0", "fast")
