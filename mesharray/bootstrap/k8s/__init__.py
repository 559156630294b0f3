"""Kubernetes: host agents as the pods of an Indexed Job (or a JobSet), found through the API.

Below :mod:`mesharray.proc`: the facade :mod:`mesharray.k8s` (``ma.k8s``)
makes ``HostMesh`` objects of what is found here. One concept per module:

- :mod:`.manifests` — :func:`manifest` builds the objects of one mesh (a
  Secret, a headless Service, an Indexed Job or a JobSet whose pods each run
  ``python -m mesharray host``), and the labels and annotations that
  discovery reads back; no dependency.
- :mod:`.yaml` — :func:`dump_yaml` prints them for ``kubectl apply -f -``
  (a small block-style emitter: no YAML library needed).
- :mod:`.api` — the official ``kubernetes`` client, imported only inside its
  functions and only when called: :func:`load_api` / :func:`close_api`,
  :func:`create_objects` / :func:`delete_objects` (a manifest's objects, all
  or nothing), :func:`read_secret`.
- :mod:`.discovery` — :func:`wait_for_hosts` watches the pods labelled
  ``mesharray/mesh=NAME`` until one Ready pod serves every index ``0 ..
  hosts-1`` (the choice is :func:`pick_hosts`, a pure function of pod dicts);
  :class:`PodWatcher` reports pods that fail or go away while attached.
- :mod:`.cli` — ``python -m mesharray k8s manifest`` (:func:`main`).

This package's namespace holds the names of all five, as
``mesharray.bootstrap.k8s.NAME``.
"""

from __future__ import annotations

from .api import INSTALL_HINT, close_api, create_objects, delete_objects, load_api, read_secret
from .cli import main
from .discovery import PodHost, PodWatcher, pick_hosts, pod_index, pod_ready, wait_for_hosts
from .manifests import INDEX_KEY, JOBSET_API, MESH_LABEL, manifest, parse_resources
from .yaml import dump_yaml

__all__ = ["manifest", "dump_yaml", "parse_resources", "load_api", "close_api", "wait_for_hosts", "pick_hosts",
           "PodHost", "PodWatcher", "create_objects", "delete_objects", "read_secret", "pod_index", "pod_ready",
           "main", "MESH_LABEL", "INDEX_KEY", "INSTALL_HINT", "JOBSET_API"]
