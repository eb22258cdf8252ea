use std::collections::BTreeSet;

use ferry_tensor::{DType, Device, Tensor};

use super::*;
use crate::checkpoint::{self, CheckpointError};
use crate::nn::Module;

fn tiny(kv_heads: usize) -> LlamaConfig {
    LlamaConfig::new(23, 16, 24, 2, 4, kv_heads)
}

fn ids() -> Tensor {
    Tensor::from_vec(vec![1i64, 7, 3, 22, 0, 5, 9, 9, 2, 4], &[2, 5]).unwrap()
}

fn logits(model: &Llama) -> Vec<f32> {
    model.forward(&ids()).unwrap().to_vec::<f32>().unwrap()
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-llama-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn names_are_transformers_and_count_what_the_config_says() {
    ferry_tensor::manual_seed(0);
    let model = Llama::new(tiny(2), Device::Cpu).unwrap();
    let params = model.named_parameters();
    let names: BTreeSet<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
    for name in [
        "model.embed_tokens.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ] {
        assert!(names.contains(name), "{name} not in {names:?}");
    }
    let count: usize = params.iter().map(|(_, t)| t.numel()).sum();
    assert_eq!(count, tiny(2).parameters());
    assert_eq!(params.len(), 1 + 2 * 9 + 1 + 1);
    let k = &params
        .iter()
        .find(|(n, _)| n.ends_with("0.self_attn.k_proj.weight"))
        .unwrap()
        .1;
    assert_eq!(k.shape(), &[8, 16]);

    let tied = LlamaConfig {
        tie_word_embeddings: true,
        attention_bias: true,
        ..tiny(2)
    };
    let model = Llama::new(tied.clone(), Device::Cpu).unwrap();
    let names: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(!names.iter().any(|n| n == "lm_head.weight"), "{names:?}");
    assert!(
        names
            .iter()
            .any(|n| n == "model.layers.0.self_attn.q_proj.bias")
    );
    assert_eq!(model.num_parameters(), tied.parameters());
    assert_eq!(model.forward(&ids()).unwrap().shape(), &[2, 5, 23]);
}

#[test]
fn grouped_query_attention_equals_full_heads_with_shared_keys() {
    ferry_tensor::manual_seed(1);
    let grouped = Llama::new(tiny(2), Device::Cpu).unwrap();
    // The same model with four key/value heads, heads 0 and 1 copies of the first shared head,
    // 2 and 3 of the second.
    let state: Vec<(String, Tensor)> = grouped
        .state_dict()
        .into_iter()
        .map(|(name, t)| {
            if name.contains("k_proj") || name.contains("v_proj") {
                let rows = t.reshape(&[2, 1, 4, 16]).unwrap();
                let full = rows
                    .broadcast_to(&[2, 2, 4, 16])
                    .unwrap()
                    .reshape(&[16, 16])
                    .unwrap();
                (name, full)
            } else {
                (name, t)
            }
        })
        .collect();
    let full = Llama::from_state_dict(tiny(4), state).unwrap();
    let (a, b) = (logits(&grouped), logits(&full));
    for (a, b) in a.iter().zip(&b) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
}

#[test]
fn a_causal_model_s_early_logits_ignore_later_tokens() {
    ferry_tensor::manual_seed(2);
    let model = Llama::new(tiny(2), Device::Cpu).unwrap();
    let a = Tensor::from_vec(vec![1i64, 2, 3, 4], &[1, 4]).unwrap();
    let b = Tensor::from_vec(vec![1i64, 2, 3, 19], &[1, 4]).unwrap();
    let (a, b) = (model.forward(&a).unwrap(), model.forward(&b).unwrap());
    let first = |t: &Tensor| t.narrow(1, 0, 3).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(first(&a), first(&b));
    let last = |t: &Tensor| t.narrow(1, 3, 1).unwrap().to_vec::<f32>().unwrap();
    assert_ne!(last(&a), last(&b));
}

#[test]
fn every_parameter_gets_a_gradient_the_tied_embedding_from_both_ends() {
    ferry_tensor::manual_seed(3);
    let config = LlamaConfig {
        tie_word_embeddings: true,
        ..tiny(2)
    };
    let model = Llama::new(config, Device::Cpu).unwrap();
    let targets = Tensor::from_vec(vec![0i64; 10], &[10]).unwrap();
    let loss = crate::nn::cross_entropy(
        &model.forward(&ids()).unwrap().reshape(&[10, 23]).unwrap(),
        &targets,
    )
    .unwrap();
    loss.backward().unwrap();
    for (name, p) in model.named_parameters() {
        let g = p.grad().unwrap_or_else(|| panic!("{name} has no gradient"));
        assert!(g.to_vec_f64().unwrap().iter().any(|v| *v != 0.0), "{name}");
    }
}

#[test]
fn a_saved_directory_loads_back_the_same_model_whole_or_in_shards() {
    ferry_tensor::manual_seed(4);
    let model = Llama::new(tiny(2), Device::Cpu).unwrap();
    let dir = scratch("roundtrip");
    model.save_pretrained(&dir).unwrap();
    let back = Llama::from_pretrained(&dir, Device::Cpu).unwrap();
    assert_eq!(back.config(), model.config());
    assert_eq!(logits(&back), logits(&model));

    // The same tensors in two shards and an index, as transformers writes large models.
    let sharded = scratch("sharded");
    std::fs::create_dir_all(&sharded).unwrap();
    std::fs::copy(dir.join("config.json"), sharded.join("config.json")).unwrap();
    let state = model.state_dict();
    let (first, second) = state.split_at(state.len() / 2);
    checkpoint::save(sharded.join("a.safetensors"), first).unwrap();
    checkpoint::save(sharded.join("b.safetensors"), second).unwrap();
    let map: serde_json::Map<String, serde_json::Value> = first
        .iter()
        .map(|(n, _)| (n.clone(), "a.safetensors".into()))
        .chain(
            second
                .iter()
                .map(|(n, _)| (n.clone(), "b.safetensors".into())),
        )
        .collect();
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let back = Llama::from_pretrained(&sharded, Device::Cpu).unwrap();
    assert_eq!(logits(&back), logits(&model));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_dir_all(&sharded).ok();
}

#[test]
fn missing_extra_and_misshapen_tensors_are_each_named() {
    ferry_tensor::manual_seed(5);
    let model = Llama::new(tiny(2), Device::Cpu).unwrap();
    let mut state: Vec<(String, Tensor)> = model
        .state_dict()
        .into_iter()
        .filter(|(n, _)| n != "model.layers.1.mlp.up_proj.weight")
        .map(|(n, t)| match n.as_str() {
            "model.norm.weight" => (n, Tensor::ones(&[17], DType::F32, Device::Cpu).unwrap()),
            _ => (n, t),
        })
        .collect();
    state.push((
        "model.layers.2.mlp.up_proj.weight".into(),
        Tensor::ones(&[2], DType::F32, Device::Cpu).unwrap(),
    ));
    // Skipped as transformers skips it.
    state.push((
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        Tensor::ones(&[2], DType::F32, Device::Cpu).unwrap(),
    ));
    let err = Llama::from_state_dict(tiny(2), state).err().unwrap();
    let CheckpointError::Mismatch { problems, .. } = &err else {
        panic!("{err}");
    };
    let keys: Vec<&str> = problems.iter().map(|p| p.key()).collect();
    assert_eq!(
        keys,
        [
            "model.layers.1.mlp.up_proj.weight",
            "model.norm.weight",
            "model.layers.2.mlp.up_proj.weight"
        ]
    );
    let text = err.to_string();
    assert!(text.contains("[17]") && text.contains("[16]"), "{text}");
}

#[test]
fn a_directory_without_config_or_weights_says_what_is_missing() {
    let dir = scratch("empty");
    std::fs::create_dir_all(&dir).unwrap();
    let err = Llama::from_pretrained(&dir, Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("config.json"), "{err}");
    std::fs::write(dir.join("config.json"), tiny(2).to_json().to_string()).unwrap();
    let err = Llama::from_pretrained(&dir, Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("save_pretrained"),
        "{err}"
    );
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"x": "../y"}}"#,
    )
    .unwrap();
    let err = Llama::from_pretrained(&dir, Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("not a file name"), "{err}");
    std::fs::write(dir.join("config.json"), r#"{"vocab_size": 4}"#).unwrap();
    let err = Llama::from_pretrained(&dir, Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("hidden_size"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_input_is_an_error_naming_the_fix() {
    let model = Llama::new(
        LlamaConfig {
            max_position_embeddings: 4,
            ..tiny(2)
        },
        Device::Cpu,
    )
    .unwrap();
    let long = Tensor::from_vec(vec![1i64; 5], &[1, 5]).unwrap();
    let err = model.forward(&long).unwrap_err().to_string();
    assert!(err.contains("at most 4 positions"), "{err}");
    let floats = Tensor::zeros(&[1, 2], DType::F32, Device::Cpu).unwrap();
    assert!(model.forward(&floats).is_err());
    let err = Llama::new(LlamaConfig::new(10, 16, 8, 1, 4, 3), Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("must divide"), "{err}");
}
