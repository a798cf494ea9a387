"""`dskit doctor` and `dskit build image`: this host or container, and the image built here."""

from __future__ import annotations

import argparse

from dskit.cli.args import Subparsers


def cmd_doctor(a: argparse.Namespace) -> int:
    from dskit.host.doctor import main as doctor_main

    return doctor_main(as_json=a.json, build=a.build)


def add_doctor(sub: Subparsers) -> None:
    s = sub.add_parser(
        "doctor",
        help="check this host/container: GPU vs image arch, flash-attn, DeepSpeed ops, NCCL, /dev/shm, RDMA",
        description="One PASS/WARN/FAIL line per check; exit code 1 if anything fails.",
    )
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--build", action="store_true", help="image build smoke test: no GPU or launcher expected")
    s.set_defaults(func=cmd_doctor)


def cmd_build(a: argparse.Namespace) -> int:
    from dskit.host.image_builder import build_image

    return build_image(
        a.gpu,
        a.fabric,
        tag=a.tag,
        engine=a.engine,
        build_args=a.build_arg,
        engine_args=a.engine_arg,
    )


def add_build(sub: Subparsers) -> None:
    s = sub.add_parser(
        "build",
        help="build a GPU profile's image with the container engine here (podman, buildah, docker)",
        description="Renders the image for --gpu (as `dskit render image`), builds it from this checkout "
        "and prints the tag, size and build time. Base images and torch's index are build arguments: "
        "--build-arg BUILDER_IMAGE=... --build-arg RUNTIME_IMAGE=... --build-arg DSKIT_TORCH_INDEX=...",
    )
    s.add_argument("what", choices=("image",), help="what to build")
    s.add_argument("--gpu", required=True, help="GPU profile (dskit catalog gpus; cpu for the CPU image)")
    s.add_argument("--fabric", default="infiniband", help="network fabric (efa adds AWS's libraries)")
    s.add_argument(
        "--tag", help="image tag (default: the rendered one, e.g. dskit:cpu-torch2.13.0-cpu-ds0.19.8)"
    )
    s.add_argument(
        "--engine", default="auto", help="podman | buildah | docker (default: the first of them found)"
    )
    s.add_argument(
        "--build-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="passed to the engine (repeatable)",
    )
    s.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra engine flag, e.g. --engine-arg=--network=host (repeatable)",
    )
    s.set_defaults(func=cmd_build)
