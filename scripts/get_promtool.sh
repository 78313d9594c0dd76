#!/usr/bin/env bash
# Best effort: fetch Debian's promtool (a static binary, ~48 MB unpacked) into a per-machine cache so
# the tests can run `promtool check rules` on configs/prometheus/alerts.yml. The full prometheus
# package would pull ~330 MB of dependencies; we only unpack the .deb. Never fatal here: without promtool
# the alert-rule tests skip, and fail where TRAINGUARD_REQUIRE names promtool (CI: .ci/run).
set -u
dest="${TRAINGUARD_CACHE:-$HOME/.cache/trainguard}/promtool"
[ -x "$dest/usr/bin/promtool" ] && exit 0
command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || exit 0
tmp="$(mktemp -d)"
(
  cd "$tmp" || exit 0
  apt-get download prometheus >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get download prometheus >/dev/null 2>&1; } || exit 0
  mkdir -p "$dest" && dpkg-deb -x prometheus_*.deb "$tmp/x" && mkdir -p "$dest/usr/bin" && cp "$tmp/x/usr/bin/promtool" "$dest/usr/bin/"
) || true
rm -rf "$tmp"
exit 0
