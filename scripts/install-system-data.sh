#!/usr/bin/env bash
# Installs the Debian text corpora privlm reads offline (WordNet, fortunes).
# Only as root and only when missing; otherwise it says what it skipped.
set -euo pipefail
packages=(wordnet-base fortunes)
missing=()
for pkg in "${packages[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "privlm: skipping Debian packages ${missing[*]} (needs root and apt-get); data loaders that use them will say so." >&2
  exit 0
fi
echo "privlm: installing Debian packages ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
