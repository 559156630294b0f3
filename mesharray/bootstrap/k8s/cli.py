"""``python -m mesharray k8s manifest ...``: print the YAML of a mesh for ``kubectl apply -f -``."""

from __future__ import annotations

import sys
from typing import Sequence

from ..agent import DEFAULT_PORT
from .manifests import manifest
from .yaml import dump_yaml

__all__ = ["main"]


def main(argv: Sequence[str]) -> int:
    """``python -m mesharray k8s manifest --name NAME --hosts N --image IMAGE [...]``: print the YAML."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m mesharray k8s",
                                 description="Kubernetes: print the manifest of a mesh of host agents "
                                             "(`... | kubectl apply -f -` launches it).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("manifest", help="print the YAML of a mesh: Secret, headless Service and Indexed Job "
                                        "(or a JobSet)")
    m.add_argument("--name", required=True, help="the mesh's name (Job, Service, label mesharray/mesh=NAME)")
    m.add_argument("--hosts", required=True, type=int, help="pods, one host agent each")
    m.add_argument("--image", required=True, help="container image with Python and mesharray installed")
    m.add_argument("--procs-per-host", type=int, default=8, help="processes per host (default 8)")
    m.add_argument("--namespace", default="default")
    m.add_argument("--jobset", action="store_true", help="a JobSet (jobset.x-k8s.io/v1alpha2) instead of a Job")
    m.add_argument("--resources", action="append", default=None, metavar="NAME=QTY[,...]",
                   help="container limits: gpu=8 (nvidia.com/gpu), amd=8 (amd.com/gpu), tpu=4 (google.com/tpu), "
                        "cpu=, memory=, or any vendor.com/name=")
    m.add_argument("--secret-name", default=None,
                   help="an existing Secret with the agents' secret under the key 'secret' (default: the "
                        "manifest defines NAME-secret with a random one)")
    m.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"the agents' port (default {DEFAULT_PORT})")
    m.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE")
    m.add_argument("--service-account", default=None)
    m.add_argument("--python", default="python", help="the interpreter in the image (default python)")
    args = ap.parse_args(list(argv))
    selector = {}
    for item in args.node_selector:
        k, eq, v = item.partition("=")
        if not eq:
            ap.error(f"--node-selector {item!r}: expected KEY=VALUE")
        selector[k] = v
    try:
        objs = manifest(args.name, args.hosts, args.image, procs_per_host=args.procs_per_host,
                        namespace=args.namespace, jobset=args.jobset, resources=args.resources,
                        secret_name=args.secret_name, port=args.port, node_selector=selector,
                        service_account=args.service_account, python=args.python)
    except (ValueError, TypeError) as exc:
        print(f"mesharray k8s manifest: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(dump_yaml(objs))
    return 0
