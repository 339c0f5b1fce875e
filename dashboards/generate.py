"""Generate the dashboards' JSON from their grafanalib sources.

    .venv/bin/python dashboards/generate.py          # write dashboards/<name>.json for every <name>.dashboard.py
    .venv/bin/python dashboards/generate.py --check  # exit 1 (and name the files) when a committed JSON differs

It needs the Python that has DPLB's dependencies (grafanalib), i.e. the virtualenv's; another one gets a one-line
error saying so.

Each ``*.dashboard.py`` defines a variable ``dashboard`` (a :class:`grafanalib.core.Dashboard`); the output is
stable (sorted keys, 2-space indent, trailing newline) so a regeneration diff is a real change.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def sources() -> list[Path]:
    return sorted(HERE.glob("*.dashboard.py"))


def output_of(src: Path) -> Path:
    return HERE / (src.name.removesuffix(".dashboard.py") + ".json")


#: Keys grafanalib still emits for pre-v8 Grafana; current Grafana ignores them, so they are left out.
LEGACY = {"rows", "style", "hideControls", "sharedCrosshair", "span", "minSpan", "height", "error", "repeatDirection",
          "auto", "auto_count", "auto_min", "useTags", "tagsQuery", "tagValuesQuery",
          "time_options"}  # timepicker.time_options: removed from Grafana's dashboard schema (@grafana/schema)


def _clean(obj: Any, key: str = "") -> Any:
    """Drop legacy keys and null values (a threshold step's ``"value": null`` base stays: Grafana needs it)."""
    if isinstance(obj, dict):
        return {k: _clean(v, k) for k, v in obj.items()
                if k not in LEGACY and (v is not None or (k == "value" and key == "steps"))}
    if isinstance(obj, list):
        return [_clean(v, key) for v in obj]
    return obj


def render(src: Path) -> str:
    """The JSON text of one dashboard source."""
    from grafanalib._gen import DashboardEncoder

    for p in (str(ROOT), str(HERE)):
        if p not in sys.path:
            sys.path.insert(0, p)
    dash = runpy.run_path(str(src))["dashboard"]
    data = json.loads(json.dumps(dash.to_json_data(), cls=DashboardEncoder))
    return json.dumps(_clean(data), sort_keys=True, indent=2) + "\n"


def generate() -> dict[Path, str]:
    """Every output path and its freshly rendered JSON text."""
    return {output_of(s): render(s) for s in sources()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed JSON instead of writing")
    args = ap.parse_args(argv)
    try:
        import grafanalib  # noqa: F401
    except ImportError:
        print(f"dashboards/generate.py: {sys.executable} lacks grafanalib (a DPLB dependency); run it with the "
              "virtualenv's python: .venv/bin/python dashboards/generate.py", file=sys.stderr)
        return 2
    stale = []
    for path, text in generate().items():
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    orphans = {p.name for p in HERE.glob("*.json")} - {output_of(s).name for s in sources()}
    if orphans:
        stale += sorted(orphans)
        print("JSON without a *.dashboard.py source: " + ", ".join(sorted(orphans)), file=sys.stderr)
    if stale:
        print("out of date (run .venv/bin/python dashboards/generate.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
