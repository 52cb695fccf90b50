"""Checks of single values in a cluster YAML (hosts, Ray addresses, endpoints, S3 URIs, zone lists), each
raising ValueError with what was expected, so pydantic reports it at the field's line."""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from typing import Annotated

import pydantic

_HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}\Z){_HOST_LABEL}(?:\.{_HOST_LABEL})*\.?")
NAMESPACE = re.compile(r"[A-Za-z0-9_.-]+")


def check_host(value: str) -> str:
    """An IP address or a hostname; raises ValueError naming what is wrong (a typo here would
    otherwise surface as a peer that nobody can reach)."""
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", value):  # looks like IPv4 but is not one: never a hostname
        raise ValueError(f"{value!r} is not a valid IP address")
    if not _HOSTNAME.fullmatch(value):
        raise ValueError(f"{value!r} is neither an IP address nor a hostname")
    return value


def check_ray_address(value: str) -> str:
    """``auto`` or ``HOST:PORT`` (IPv6 in brackets); raises ValueError naming what is wrong."""
    if value == "auto":
        return value
    expected = "expected 'auto' or HOST:PORT, e.g. 10.0.0.5:6379"
    if "://" in value:
        raise ValueError(f"{value!r}: a URL (a Ray Client address?); {expected}, the head's GCS address")
    if value.startswith("["):
        host, sep, port = value[1:].partition("]:")
        if not sep:
            raise ValueError(f"{value!r}: {expected}")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{value!r}: {host!r} in brackets is not an IPv6 address") from None
    else:
        host, sep, port = value.rpartition(":")
        if not sep or not host:
            raise ValueError(f"{value!r}: {expected}")
        if ":" in host:
            raise ValueError(f"{value!r}: an IPv6 host goes in brackets, e.g. [::1]:6379")
        try:
            check_host(host)
        except ValueError as e:
            raise ValueError(f"{value!r}: {e}") from None
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r}: port {port!r} is not a number from 1 to 65535")
    return value


def check_endpoint_url(value: str) -> str:
    """An ``http://`` or ``https://`` URL with a host (an S3- or EC2-compatible endpoint, e.g. moto's)."""
    try:
        parts = urllib.parse.urlsplit(value)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and value.isprintable()
        parts.port  # noqa: B018 - raises ValueError on a port that is not one
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{value!r} is not an http:// or https:// URL, e.g. http://127.0.0.1:5000")
    return value


_S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_GCS_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")


def check_archive_uri(value: str) -> str:
    """``s3://bucket[/prefix]``, ``gs://bucket[/prefix]`` (each with its store's bucket naming rules), or
    an absolute path (``file://`` too): where a run's history and checkpoints outlive its head."""
    if "://" not in value:
        if not (value.startswith("/") or value.startswith("~")):
            raise ValueError(f"{value!r}: an archive directory must be an absolute path (or s3://bucket/prefix, "
                             "gs://bucket/prefix)")
        return value
    scheme, _, rest = value.partition("://")
    if scheme == "file":
        return value
    rules = {"s3": (_S3_BUCKET, "an S3 bucket name (3 to 63 lowercase letters, digits, dots and hyphens"),
             "gs": (_GCS_BUCKET, "a Cloud Storage bucket name (3 to 63 lowercase letters, digits, dots, hyphens "
                                 "and underscores")}
    if scheme not in rules:
        raise ValueError(f"{value!r}: archives are s3://bucket/prefix, gs://bucket/prefix or an absolute path")
    bucket, _, prefix = rest.partition("/")
    pattern, what = rules[scheme]
    if not pattern.fullmatch(bucket):
        raise ValueError(f"{value!r}: {bucket!r} is not {what}, starting and ending with a letter or digit)")
    if not prefix.isprintable():
        raise ValueError(f"{value!r}: the key prefix has a control character")
    return value


def check_announce_host(value: str) -> str:
    """A host other peers can reach: an address or hostname, never a wildcard to listen on."""
    check_host(value)
    try:
        wildcard = ipaddress.ip_address(value).is_unspecified
    except ValueError:  # a hostname
        wildcard = False
    if wildcard:
        raise ValueError(f"{value!r} is a wildcard to listen on; announce an address other peers can reach")
    return value


# checked strings for the config models: each check runs once, wherever the type is used
Host = Annotated[str, pydantic.AfterValidator(check_host)]
AnnounceHost = Annotated[str, pydantic.AfterValidator(check_announce_host)]
RayAddress = Annotated[str, pydantic.AfterValidator(check_ray_address)]
EndpointUrl = Annotated[str, pydantic.AfterValidator(check_endpoint_url)]
ArchiveUri = Annotated[str, pydantic.AfterValidator(check_archive_uri)]


def split_zones(value: str) -> list[str]:
    """Ray's ``provider.availability_zone``, ``"us-east-1a,us-east-1b"``, as a list of zones."""
    return [zone.strip() for zone in value.split(",")]
