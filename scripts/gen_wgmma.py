# Emits the wgmma wrappers of flash_attention_sm90.cu (one asm statement per shape and operand
# source; the accumulator list is long, so it is generated rather than typed).
def ss(n, ty):
    nd = n // 2
    regs = ", ".join(f"%{i}" for i in range(nd))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nd))
    a, b, sc = nd, nd + 1, nd + 2
    return f'''    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{sc}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty} "
        "{{{regs}}}, %{a}, %{b}, p, 1, 1, %{sc+1}, %{sc+2};\\n}}\\n"
        : {outs}
        : "l"(da), "l"(db), "r"(accumulate), "n"(TA), "n"(TB));'''

def rs(n, ty):
    nd = n // 2
    regs = ", ".join(f"%{i}" for i in range(nd))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nd))
    a0 = nd
    b, sc = nd + 4, nd + 5
    return f'''    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{sc}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty} "
        "{{{regs}}}, {{%{a0}, %{a0+1}, %{a0+2}, %{a0+3}}}, %{b}, p, 1, 1, %{sc+1};\\n}}\\n"
        : {outs}
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate), "n"(TB));'''

out = []
for n in (32, 64, 128):
    out.append(f'''// d (64 x {n} f32 per warpgroup) = (accumulate ? d : 0) + A · B, A (64 x 16) and B (16 x {n}) from
// shared memory through descriptors; TA / TB: 1 when the operand is MN-major (transposed).
template <typename T, int TA, int TB>
__device__ __forceinline__ void wgmma_ss(float (&d)[{n // 2}], uint64_t da, uint64_t db, int accumulate) {{
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {{
{ss(n, "bf16")}
    }} else {{
{ss(n, "f16")}
    }}
}}

// The same with A from registers (the m16n8k16 A-fragment layout, one per warp's 16 rows).
template <typename T, int TB>
__device__ __forceinline__ void wgmma_rs(float (&d)[{n // 2}], const uint32_t (&a)[4], uint64_t db, int accumulate) {{
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {{
{rs(n, "bf16")}
    }} else {{
{rs(n, "f16")}
    }}
}}
''')
print("\n".join(out))
