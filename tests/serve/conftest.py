"""The proxy's tests: the scripted upstream and a proxy in front of it (tests/helpers/proxy_fixtures.py)."""

from helpers.proxy_fixtures import proxy, upstream

__all__ = ["proxy", "upstream"]
