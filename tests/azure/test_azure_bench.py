"""The Azure figures' script (docs/object-stores.md, "Azure Blob Storage") runs, on a small
state: both sides move the bytes, the requests are counted, ckptstream's memory stays bounded."""

from __future__ import annotations

import json
from pathlib import Path

from tests.azure import azure_bench
from tests.azure.azurite import require_azurite


def test_the_azure_figures_script(tmp_path: Path) -> None:
    require_azurite()
    out = tmp_path / "figures.json"
    assert azure_bench.main(["--mib", "48", "--runs", "2", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert all(len(v) == 2 and min(v) > 0 for v in figures["gbps"].values())
    parts = -(-48 * (1 << 20) // figures["buffer_size"])
    assert figures["requests"]["upload_blob"] == {"PUT block": parts, "PUT blocklist": 1}
    save = figures["requests"]["save"]
    assert save["PUT blocklist"] == 1
    assert parts <= save["PUT block"] <= parts + 2  # the head, cut where the header ends
    assert figures["rss"]["save"] <= figures["staging"] + 64 * (1 << 20)
