"""Every provider and sandbox class has what ``sandboxes/base.py``'s protocols name (the session's reads
among them), read from the classes themselves: a provider that cannot start here (ECS, Slurm, a
container without podman) is held to it as well, and a member added to a protocol fails here until every
class has it."""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing

import pytest

from sandboxes.base import Sandbox, SandboxProvider
from sandboxes.container import ContainerSandbox, ContainerSandboxProvider
from sandboxes.ecs import EcsSandboxProvider
from sandboxes.local import LocalSandbox, LocalSandboxProvider
from sandboxes.remote import RemoteSandbox
from sandboxes.slurm import SlurmSandboxProvider
from sandboxes.testing.faults import FlakyStartProvider

PROVIDERS = [
    LocalSandboxProvider,
    ContainerSandboxProvider,
    SlurmSandboxProvider,
    EcsSandboxProvider,
    FlakyStartProvider,
]
SANDBOXES = [LocalSandbox, RemoteSandbox, ContainerSandbox]  # ECS and Slurm start RemoteSandboxes
OPTIONAL = {"isolation_label", "gateway_url", "check_runs", "python_argv"}


def protocol_members(protocol: type) -> set[str]:
    names = set(protocol.__annotations__)
    return names | {name for name, value in vars(protocol).items() if callable(value) and name[0] != "_"}


def class_members(cls: type) -> set[str]:
    """Its attributes and methods, and every ``self.<name>`` its own or its bases' methods assign: an
    instance's attributes, without starting one."""
    names = set(dir(cls))
    for klass in cls.__mro__[:-1]:  # object aside
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(klass)))):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            else:
                continue
            for target in targets:
                if isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "self":
                    names.add(target.attr)
    return names


@pytest.mark.parametrize("cls", PROVIDERS, ids=lambda cls: cls.__name__)
def test_every_provider_class_has_what_the_provider_protocol_names(cls: type) -> None:
    assert protocol_members(SandboxProvider) - class_members(cls) == set()


@pytest.mark.parametrize("cls", SANDBOXES, ids=lambda cls: cls.__name__)
def test_every_sandbox_class_has_what_the_sandbox_protocol_names(cls: type) -> None:
    assert protocol_members(Sandbox) - class_members(cls) == set()


def test_the_optional_parts_are_named_as_optional() -> None:
    """Optional means None is an answer the session handles, not an attribute that may be missing."""
    for protocol in (Sandbox, SandboxProvider):
        hints = typing.get_type_hints(protocol)
        for name in OPTIONAL & set(hints):
            assert type(None) in typing.get_args(hints[name]), f"{protocol.__name__}.{name}"
    assert OPTIONAL <= protocol_members(Sandbox)
    assert "isolation_label" in protocol_members(SandboxProvider)
    # Where a class has none of a part, it says None rather than leave the attribute out.
    assert LocalSandbox.isolation_label is None and LocalSandbox.gateway_url is None
    assert LocalSandbox.check_runs is None and RemoteSandbox.check_runs is None
    assert callable(ContainerSandbox.check_runs) and callable(RemoteSandbox.gateway_url)


def test_the_session_reads_capabilities_from_the_classes_not_a_provider_name(tmp_path) -> None:
    """What a session may do with a sandbox (stop its harness early, run two commands in one exec, start
    the grading sandbox beside the harness) is a capability its class says it has: a local provider by
    another name keeps them, and no other provider claims them."""
    from sandboxes.base import RunsBefore, StartsInMilliseconds, StopsOnEvent

    renamed = LocalSandboxProvider(tmp_path, name="node-a")
    assert isinstance(renamed, StartsInMilliseconds)
    sandbox = LocalSandbox.__new__(LocalSandbox)
    assert isinstance(sandbox, StopsOnEvent) and isinstance(sandbox, RunsBefore)
    assert isinstance(FlakyStartProvider(renamed, 0.5), StartsInMilliseconds)  # a wrapper keeps it
    others = [cls for cls in PROVIDERS if cls not in (LocalSandboxProvider, FlakyStartProvider)]
    assert not any("starts_in_milliseconds" in class_members(cls) for cls in others)
    others = [cls for cls in SANDBOXES if cls is not LocalSandbox]
    assert not any({"stops_on_event", "runs_before"} & class_members(cls) for cls in others)
