#!/usr/bin/env bash
# Vulkan headers new enough for ggml's Vulkan backend (1.3.261+: VK_EXT_layer_settings), for a
# machine whose own are older (Debian 12: 1.3.239). Run as root in the clone:
#
#     bash .ci/vulkan-headers.sh      # prints the folder to pass as -DVulkan_INCLUDE_DIR=...
#
# Debian 13's libvulkan-dev is downloaded and unpacked into .ci/vulkan-headers (headers only;
# nothing of the system is upgraded). The suite is added from the machine's own Debian source
# (its URIs and keyring, .ci/apt_source.py) at a low pin priority, so apt never prefers it.
set -euo pipefail
cd "$(dirname "$0")"
suite="${1:-trixie}"
if [ ! -f vulkan-headers/usr/include/vulkan/vulkan.hpp ]; then
  python3 apt_source.py "$suite" > "/etc/apt/sources.list.d/potluck-ci-$suite.sources"
  printf 'Package: *\nPin: release n=%s\nPin-Priority: 50\n' "$suite" \
    > "/etc/apt/preferences.d/potluck-ci-$suite"
  apt-get update -qq
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download -qq "libvulkan-dev/$suite" 2>/dev/null)
  dpkg -x "$tmp"/libvulkan-dev_*.deb vulkan-headers
  rm -rf "$tmp"
fi
echo "$PWD/vulkan-headers/usr/include"
