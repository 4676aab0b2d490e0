# Sourced by gpu_check.sh and syntax_check.sh: the one rewrite every CUDA build of the kernels
# needs. copy_metal FOLDER FAULT SOURCE... copies the sources into FOLDER with MSL's address-space
# word `device` renamed `fa_device` (a macro named `device` would break CUDA's own __device__,
# which expands to __location__(device)); a further sed expression FAULT (may be empty) plants a
# fault.
copy_metal() {
    local folder=$1 fault=$2 source
    shift 2
    mkdir -p "$folder"
    for source in "$@"; do
        sed -e 's/\bdevice\b/fa_device/g' ${fault:+-e "$fault"} "$source" \
            >"$folder/$(basename "$source")" || return 1
    done
}
