# Sourced by the ncu_*.sh scripts: ncu_summary W TAG TITLE TOP prints Nsight Compute's details and the per-region
# stall summary (benchmarks/probes/ncu_regions.py, TOP instructions) of the report $W/rep_TAG.ncu-rep, keeping
# $W/details_TAG.txt, $W/src_TAG.csv (the SASS source page) and $W/regions_TAG.txt. Sourcing it sets NCU (ncu on
# the PATH, else CUDA's) and W (a fresh work directory).
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
W=$(mktemp -d)
ncu_summary() {
  local W=$1 tag=$2 title=$3 top=${4:-25}
  "$NCU" --import "$W/rep_$tag.ncu-rep" --print-summary none > "$W/details_$tag.txt" 2>&1
  "$NCU" --import "$W/rep_$tag.ncu-rep" --page source --csv --print-source sass > "$W/src_$tag.csv" 2>&1
  echo "== $title"
  grep -E "Duration|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|No Eligible|Issued Warp|Issue Slots Busy|Executed Ipc A" \
    "$W/details_$tag.txt"
  python3 benchmarks/probes/ncu_regions.py "$W/src_$tag.csv" --top "$top" > "$W/regions_$tag.txt" 2>&1
  head -60 "$W/regions_$tag.txt" | cut -c1-220
}
