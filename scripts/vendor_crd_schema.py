#!/usr/bin/env python3
"""Vendor a CustomResourceDefinition's schema for moepipe's manifest tests (run by hand).

    scripts/vendor_crd_schema.py CRD.yaml OUT.json --repository OWNER/NAME --tag TAG \
        --commit SHA --path PATH_IN_REPO

Writes ``{source, group, kind, version, openAPIV3Schema}`` for the CRD's served storage version,
with ``description`` fields dropped (they are most of the bytes). Pod templates embedded in the
schema (a ``{metadata, spec}`` object whose ``spec`` has ``containers``) keep their metadata
schema; their ``spec`` becomes ``{"type": "object", "x-moepipe-validate-as":
"io.k8s.api.core.v1.PodSpec"}``: the tests validate it with Kubernetes' own PodSpec schema
(kubernetes-validate, strict), which is what the CRD's copy was generated from.
"""

import argparse
import hashlib
import json
from pathlib import Path

import yaml

POD_SPEC = {"type": "object", "x-moepipe-validate-as": "io.k8s.api.core.v1.PodSpec"}


def strip(node):
    if isinstance(node, dict):
        props = node.get("properties", {})
        spec = props.get("spec", {}).get("properties", {})
        out = {k: strip(v) for k, v in node.items() if k != "description"}
        if set(props) == {"metadata", "spec"} and "containers" in spec:
            out["properties"]["spec"] = POD_SPEC
        return out
    if isinstance(node, list):
        return [strip(x) for x in node]
    return node


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("crd", type=Path)
    ap.add_argument("out", type=Path)
    for flag in ("--repository", "--tag", "--commit", "--path"):
        ap.add_argument(flag, required=True)
    args = ap.parse_args()
    raw = args.crd.read_bytes()
    crd = yaml.safe_load(raw)
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    doc = {"source": {"repository": args.repository, "tag": args.tag, "commit": args.commit,
                      "path": args.path, "sha256": hashlib.sha256(raw).hexdigest()},
           "group": crd["spec"]["group"], "kind": crd["spec"]["names"]["kind"],
           "version": version["name"],
           "openAPIV3Schema": strip(version["schema"]["openAPIV3Schema"])}
    args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
