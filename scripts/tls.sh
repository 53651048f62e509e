#!/usr/bin/env bash
# A throwaway local CA and a server certificate for 127.0.0.1/localhost, for TLS tests.
#
#   scripts/tls.sh DIR
#
# Writes DIR/ca.pem, DIR/server.pem, DIR/server.key and DIR/server-combined.pem (cert + key,
# as mongod wants it), valid for two days, and client certificates for mutual TLS:
#   client.pem, client.key, client-combined.pem    signed by the CA, valid for two days
#   expired.pem, expired.key, expired-combined.pem signed by the CA, expired in 2020
#   rogue.pem, rogue.key, rogue-combined.pem       signed by another CA the nodes do not trust
# Keys never leave DIR.
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
printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n' >client.ext
# client NAME SUBJECT ISSUER: a client key and certificate signed by ISSUER (ca or rogue-ca).
client() {
  openssl req -newkey rsa:2048 -nodes -subj "/CN=$2" -keyout "$1.key" -out "$1.csr" 2>/dev/null
  openssl x509 -req -in "$1.csr" -CA "$3.pem" -CAkey "$3.key" -CAcreateserial -days 2 \
    -extfile client.ext -out "$1.pem" 2>/dev/null
  cat "$1.pem" "$1.key" >"$1-combined.pem"
}
client client lily-client ca
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=lily-rogue-ca" \
  -keyout rogue-ca.key -out rogue-ca.pem 2>/dev/null
client rogue lily-client rogue-ca
# An expired certificate needs explicit dates, which only `openssl ca` takes.
mkdir -p expired-ca
: >expired-ca/index.txt
printf '[ca]\ndefault_ca=lily\n[lily]\ndir=expired-ca\ndatabase=$dir/index.txt\nnew_certs_dir=$dir\nserial=$dir/serial\ncertificate=ca.pem\nprivate_key=ca.key\ndefault_md=sha256\npolicy=any\nunique_subject=no\n[any]\ncommonName=supplied\n' >expired-ca/ca.cnf
echo 01 >expired-ca/serial
openssl req -newkey rsa:2048 -nodes -subj "/CN=lily-client" -keyout expired.key -out expired.csr 2>/dev/null
openssl ca -batch -config expired-ca/ca.cnf -extfile client.ext -notext \
  -startdate 20200101000000Z -enddate 20200102000000Z -in expired.csr -out expired.pem 2>/dev/null
cat expired.pem expired.key >expired-combined.pem
chmod 600 ./*.key ./*-combined.pem
rm -rf ./*.csr ./*.ext ./*.srl expired-ca
