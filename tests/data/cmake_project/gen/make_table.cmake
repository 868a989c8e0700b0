# Writes table.cpp: the squares 0..15 as a lookup table (run as a custom command).
set(values "")
foreach(i RANGE 15)
  math(EXPR sq "${i} * ${i}")
  string(APPEND values "${sq}, ")
endforeach()
file(WRITE "${OUT}" "static const int table[16] = {${values}};\nint demo_table_at(int i) { return table[i & 15]; }\n")
