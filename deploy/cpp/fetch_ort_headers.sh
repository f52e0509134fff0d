#!/usr/bin/env bash
# Fetch the ONNX Runtime C/C++ headers from Debian's libonnxruntime-dev package (and the header-only JSON
# parser from nlohmann-json3-dev, for manifest.json and tokenizer.json, and utf8proc from libutf8proc-dev: its
# header and static library, the Unicode data of the C++ tokenizer) into a project-local dir; nothing is installed.
#
#   deploy/cpp/fetch_ort_headers.sh [DEST]      (default DEST: deploy/cpp/third_party/ort)
#
# This machine may run an older Debian (bookworm has no libonnxruntime-dev), so the package is fetched from
# a newer suite (trixie by default; ORT_DEBIAN_SUITE overrides) WITHOUT touching the system's apt sources:
# a private sources list, lists dir and cache under DEST/apt are passed to apt-get with -o options.
# No mirror host is hard-coded: the Debian archive URI is read from the machine's own apt configuration
# (`apt-get indextargets`, falling back to the deb822/one-line source files), and the signing keyring is
# the system's debian-archive-keyring, so the downloaded package is verified like any apt download.
# The C API is ABI-stable: headers of an older ORT (ORT_API_VERSION N) work with any newer library, so the
# headers need not match the pip wheel's version exactly (CMakeLists.txt checks header <= library).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
dest="${1:-$here/third_party/ort}"
suite="${ORT_DEBIAN_SUITE:-trixie}"
keyring="${ORT_DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}"

if [ -f "$dest/include/onnxruntime_cxx_api.h" ] && [ -f "$dest/include/nlohmann/json.hpp" ] \
        && [ -f "$dest/include/utf8proc.h" ] && [ -f "$dest/lib/libutf8proc.a" ]; then
    echo "ORT headers and utf8proc already in $dest"; exit 0
fi
for tool in apt-get dpkg-deb; do
    command -v "$tool" >/dev/null || { echo "error: $tool not found (a Debian-based system is needed to fetch the headers)" >&2; exit 1; }
done

# The Debian archive URI this machine already uses (first source whose Release origin is Debian and which
# is not the security archive).
uri="$(apt-get indextargets --format '$(ORIGIN)|$(SUITE)|$(REPO_URI)' 2>/dev/null \
        | awk -F'|' '$1 == "Debian" && $2 !~ /security/ { print $3; exit }')"
if [ -z "$uri" ]; then
    uri="$( { cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk 'tolower($1) == "uris:" { for (i = 2; i <= NF; i++) print $i }';
              cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
                | awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z+]+:\/\//) { print $i; break } }'; } \
            | grep -v -e security -e '^$' | grep -i debian | head -n 1 || true)"
fi
if [ -z "$uri" ]; then
    echo "error: no Debian archive found in this machine's apt configuration (/etc/apt/sources.list*)" >&2; exit 1
fi
[ -r "$keyring" ] || { echo "error: Debian archive keyring $keyring not found (install debian-archive-keyring)" >&2; exit 1; }

work="$dest/apt"
rm -rf "$work"
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs" "$work/etc/preferences.d"
echo "deb [signed-by=$keyring] ${uri%/} $suite main" > "$work/sources.list"
: > "$work/etc/preferences"
opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=$work/none"
      -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
      -o "Dir::Etc::Preferences=$work/etc/preferences" -o "Dir::Etc::PreferencesParts=$work/etc/preferences.d"
      -o "APT::Sandbox::User=root" -o "Debug::NoLocking=1" -o "Acquire::Languages=none"
      -o "APT::Architecture=$(dpkg --print-architecture)" -o "APT::Architectures=$(dpkg --print-architecture)")
echo "fetching libonnxruntime-dev, nlohmann-json3-dev and libutf8proc-dev from $uri ($suite) via a private apt configuration in $work"
apt-get -q "${opts[@]}" update >"$work/update.log" 2>&1 || { cat "$work/update.log" >&2; echo "error: apt-get update of $uri $suite failed" >&2; exit 1; }
(cd "$work/debs" && apt-get -q "${opts[@]}" download libonnxruntime-dev nlohmann-json3-dev libutf8proc-dev) >"$work/download.log" 2>&1 \
    || { cat "$work/download.log" >&2; echo "error: apt-get download libonnxruntime-dev nlohmann-json3-dev libutf8proc-dev failed" >&2; exit 1; }
deb="$(ls "$work"/debs/libonnxruntime-dev_*.deb | head -n 1)"
mkdir -p "$work/x"
for d in "$work"/debs/*.deb; do dpkg-deb -x "$d" "$work/x"; done
hdr="$(dirname "$(find "$work/x" -name onnxruntime_cxx_api.h | head -n 1)")"
[ -f "$hdr/onnxruntime_c_api.h" ] || { echo "error: $deb has no onnxruntime_c_api.h" >&2; exit 1; }
json="$(find "$work/x" -path '*/nlohmann/json.hpp' | head -n 1)"
[ -n "$json" ] || { echo "error: nlohmann-json3-dev has no nlohmann/json.hpp" >&2; exit 1; }
u8h="$(find "$work/x" -name utf8proc.h | head -n 1)"
u8a="$(find "$work/x" -name libutf8proc.a | head -n 1)"
[ -n "$u8h" ] && [ -n "$u8a" ] || { echo "error: libutf8proc-dev has no utf8proc.h or libutf8proc.a" >&2; exit 1; }
tmp="$dest/.include.tmp"
rm -rf "$tmp" && mkdir -p "$tmp" && cp -r "$hdr"/. "$tmp"/ && cp -r "$(dirname "$json")" "$tmp/nlohmann" \
    && cp "$u8h" "$tmp/" && rm -rf "$dest/include" && mv "$tmp" "$dest/include"
mkdir -p "$dest/lib" && cp "$u8a" "$dest/lib/.libutf8proc.a.tmp" && mv "$dest/lib/.libutf8proc.a.tmp" "$dest/lib/libutf8proc.a"
(cd "$work/debs" && ls *.deb) > "$dest/SOURCE"
rm -rf "$work/x" "$work/lists" "$work/cache"
echo "ORT headers ($(basename "$deb"), $(grep -m1 -o 'define ORT_API_VERSION [0-9]*' "$dest/include/onnxruntime_c_api.h")) -> $dest/include"
