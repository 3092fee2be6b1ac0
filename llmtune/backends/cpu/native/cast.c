/* Float casts for the file writers: float32 or bfloat16 values to fp16, rounded to nearest even as
 * numpy's astype(float16) and ggml's GGML_FP32_TO_FP16 round them (llmtune import's F16 output:
 * convert_hf_to_gguf.py's data.astype(np.float16)). F16C eight at a time where the compiler has it. */
#include "common.h"

void lt_to_f16(const void *src, int64_t n, int bf16, uint16_t *out) {
    const float *f = (const float *)src;
    const uint16_t *b = (const uint16_t *)src;
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        __m256 x = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                              _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + i))), 16))
                        : _mm256_loadu_ps(f + i);
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
#endif
    for (; i < n; i++) out[i] = f32_to_f16(bf16 ? fp32_from_bits((uint32_t)b[i] << 16) : f[i]);
}
