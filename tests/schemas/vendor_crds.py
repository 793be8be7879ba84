"""Write the schemas of CustomResourceDefinitions beside this file, for offline checks.

    python tests/schemas/vendor_crds.py CRD.yaml [CRD.yaml ...]

The stored version's `openAPIV3Schema` becomes `<kind>-<group>-<version>.json`
(lower case), without its `description`s: what a manifest is checked against,
not documentation. SOURCES.md says which upstream files these came from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent


def _without_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_without_descriptions(v) for v in node]
    return node


def vendor(crd_file: Path) -> list[Path]:
    """The schema files written for one CRD file (its stored version's)."""
    written = []
    for crd in yaml.safe_load_all(crd_file.read_text()):
        if not crd or crd.get("kind") != "CustomResourceDefinition":
            continue
        spec = crd["spec"]
        for version in spec["versions"]:
            if not version.get("storage"):
                continue
            name = f"{spec['names']['kind']}-{spec['group']}-{version['name']}".lower()
            target = HERE / f"{name}.json"
            schema = _without_descriptions(version["schema"]["openAPIV3Schema"])
            target.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
            written.append(target)
    return written


if __name__ == "__main__":
    for path in sys.argv[1:]:
        for written in vendor(Path(path)):
            print(written.name)
