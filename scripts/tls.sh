#!/usr/bin/env bash
# A throwaway local CA and a server certificate for 127.0.0.1/localhost, for TLS tests.
#
#   scripts/tls.sh DIR
#
# Writes DIR/ca.pem, DIR/server.pem, DIR/server.key and DIR/server-combined.pem (cert + key,
# as mongod wants it), valid for two days. Keys never leave DIR.
set -euo pipefail
dir=$1
mkdir -p "$dir"
cd "$dir"
if ! command -v openssl >/dev/null; then
  echo "lily: installing openssl from Debian packages" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssl >&2
fi
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=lily-test-ca" \
  -keyout ca.key -out ca.pem 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" \
  -keyout server.key -out server.csr 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' >server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
  -extfile server.ext -out server.pem 2>/dev/null
cat server.pem server.key >server-combined.pem
chmod 600 ca.key server.key server-combined.pem
rm -f server.csr server.ext ca.srl
