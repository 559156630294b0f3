"""Actors of the Kubernetes tests (importable by the workers: tests/k8s is on sys.path)."""

from __future__ import annotations

import os

import mesharray as ma


class Where(ma.Actor):
    """Says which pod it runs in."""

    @ma.endpoint
    def where(self) -> tuple:
        return os.environ.get("MESHARRAY_HOST_ID"), ma.context().global_rank, os.getpid()
