# mmdebstrap customize hook for the test's Debian base image (tests/deploy/engine.py): the
# image trusts the certificate authorities this machine trusts, and so does pip.
#
# Machines that reach PyPI through a TLS-inspecting proxy trust its CA through
# /usr/local/share/ca-certificates (Debian's place for local CAs); pip in the Dockerfile's
# build stage must trust it too, and pip reads its own bundle unless told otherwise. On a
# machine without local CAs this copies nothing, and pip reads Debian's bundle, which holds
# the same public CAs as pip's own.
set -eu
root="$1"
if [ -d /usr/local/share/ca-certificates ]; then
  cp -R /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
fi
chroot "$root" update-ca-certificates >/dev/null
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$root/etc/pip.conf"
