# Sourced by the device scripts here: install_wheels NAME... puts each wheel of .whl-ab/NAME
# (built on the development machine) into /tmp/site-NAME, for PYTHONPATH=/tmp/site-NAME
# python -P; and makes the carried fabtests (.fabtests) executable where they came along.
install_wheels() {
  local w
  for w in "$@"; do
    rm -rf "/tmp/site-$w"
    "${PY:-python3}" -m pip install -q --no-deps --no-index --no-compile --target "/tmp/site-$w" \
      .whl-ab/"$w"/afabric-*.whl 2>&1 | grep -v "Running pip"
  done
  if [ -d .fabtests ]; then chmod +x .fabtests/*; fi
}
