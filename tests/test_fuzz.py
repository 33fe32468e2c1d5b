"""10,000 hostile messages of every family against a live coordinator over Mosquitto, mid-round."""
from __future__ import annotations

from bench.fuzz import FAMILIES, fuzz_live

RSS_GROWTH_MB = 300  # the bound stated in the README's security model


def test_ten_thousand_hostile_messages_leave_the_coordinator_working(tmp_path, mosquitto):
    figures = fuzz_live(tmp_path, mosquitto.url, 10_000, round_timeout_s=240)
    assert figures["handled"] >= 10_000, figures
    assert figures["rejected"] >= 10_000, "every hostile message is refused with a reason"
    assert figures["handler_errors"] == 0, "no message reached an unexpected exception"
    assert set(figures["per_family"]) == set(FAMILIES) and min(figures["per_family"].values()) >= 900
    assert figures["honest_round"] == "completed" and figures["honest_updates"] == 2, figures
    assert figures["coordinator_mqtt"] == "connected"
    assert figures["rss_after_mb"] - figures["rss_before_mb"] < RSS_GROWTH_MB, figures
