"""`sbatch-gen schema`: every property of every profile kind says what it is (the editor shows it as the
field's help)."""

from __future__ import annotations

import json

import pytest

from .conftest import sg


def _undescribed(node: object, at: str = "#") -> tuple[int, list[str]]:
    """(properties seen, those without a description) anywhere in a JSON schema, $defs included."""
    seen, missing = 0, []
    if isinstance(node, dict):
        props = node.get("properties")
        if isinstance(props, dict):
            for name, sub in props.items():
                seen += 1
                text = sub.get("description") if isinstance(sub, dict) else None
                if not (isinstance(text, str) and text.strip()):
                    missing.append(f"{at}/properties/{name}")
        for key, sub in node.items():
            n, m = _undescribed(sub, f"{at}/{key}")
            seen, missing = seen + n, missing + m
    elif isinstance(node, list):
        for i, sub in enumerate(node):
            n, m = _undescribed(sub, f"{at}/{i}")
            seen, missing = seen + n, missing + m
    return seen, missing


@pytest.mark.parametrize("args", [(), ("--kind", "slurm"), ("--kind", "ssh")], ids=["all", "slurm", "ssh"])
def test_every_schema_property_has_a_description(args):
    r = sg("schema", *args)
    assert r.code == 0, r.err
    seen, missing = _undescribed(json.loads(r.out))
    assert seen > 100  # the walk reached the sections' $defs
    assert missing == [], f"{len(missing)} of {seen} properties have no description: {missing}"
