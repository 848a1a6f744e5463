// Statements that metal.py pastes into metal_split.metal's load_k / load_v placeholders: a section
// runs from its line `//@ NAME` to the next, and its lines are joined by spaces.
//@ LOAD_NATIVE_K
for (int d = 0; d < DPL; ++d) kv[d] = float(kc[at[u] * D + sub * DPL + d]);
//@ LOAD_NATIVE_V
for (int d = 0; d < DPL; ++d) kv[d] = float(vc[at[u] * D + sub * DPL + d]);
//@ LOAD_PACKED_K
device const uint* words = (device const uint*)(kc + at[u] * (D * K_BITS / 8) + sub * (DPL * K_BITS / 8));
for (int d = 0; d < DPL; ++d) kv[d] = kv_code<K_BITS>(words[d / (32 / K_BITS)], d);
k_scale = ks[at[u] * (D / GROUP) + (sub * DPL) / GROUP];
k_offset = ko[at[u] * (D / GROUP) + (sub * DPL) / GROUP];
//@ LOAD_PACKED_V
device const uint* words = (device const uint*)(vc + at[u] * (D * V_BITS / 8) + sub * (DPL * V_BITS / 8));
for (int d = 0; d < DPL; ++d) kv[d] = kv_code<V_BITS>(words[d / (32 / V_BITS)], d);
v_scale = vs[at[u] * (D / GROUP) + (sub * DPL) / GROUP];
v_offset = vo[at[u] * (D / GROUP) + (sub * DPL) / GROUP];
