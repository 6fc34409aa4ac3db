// llama_logits MODEL N_CTX IDS... : llama.cpp's own logits for a prompt of token ids, every row,
// one line per token ("%.7g" separated by spaces) on stdout. Built against the reference
// llama.cpp (bench/README.md) by tests/test_model_reference.py: an independent check of Potluck's
// quantized path (llama.cpp's kernels and its own graph of each architecture).
#include <stdio.h>
#include <stdlib.h>
#include "llama.h"

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL N_CTX ID...\n", argv[0]);
        return 2;
    }
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) atoi(argv[2]);
    cp.n_batch = cp.n_ctx;
    cp.n_ubatch = cp.n_ctx;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot make a context\n"); return 1; }
    const int n = argc - 3;
    llama_token * ids = malloc(sizeof(llama_token) * n);
    for (int i = 0; i < n; i++) ids[i] = atoi(argv[3 + i]);
    struct llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = ids[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (int i = 0; i < n; i++) {
        const float * row = llama_get_logits_ith(ctx, i);
        for (int j = 0; j < n_vocab; j++) printf(j ? " %.7g" : "%.7g", row[j]);
        printf("\n");
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    free(ids);
    return 0;
}
