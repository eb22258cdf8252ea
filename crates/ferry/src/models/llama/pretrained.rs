//! A Llama from and to a directory in transformers' layout: `config.json` beside
//! `model.safetensors` (or the shards `model.safetensors.index.json` names).

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use ferry_tensor::{DType, Device, Tensor};
use ferry_transfer::StateDict;
use serde_json::Value;

use super::{Kind, Llama, LlamaConfig};
use crate::checkpoint::{self, CheckpointError};
use crate::nn::{Module, check_state};

const CONFIG: &str = "config.json";
const WEIGHTS: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

impl Llama {
    /// The model a transformers directory holds (what `LlamaForCausalLM.save_pretrained`
    /// writes), on `device`, in the dtype its tensors were saved in.
    ///
    /// Every tensor the configuration calls for must be there with its shape and the
    /// embedding's dtype, and nothing else: the error lists each missing, misshapen or extra
    /// tensor. Rotary `inv_freq` buffers (older transformers saved them) and a tied head's copy
    /// of the embedding are skipped, as transformers skips them.
    pub fn from_pretrained(dir: impl AsRef<Path>, device: Device) -> Result<Self, CheckpointError> {
        let dir = dir.as_ref();
        let config_path = dir.join(CONFIG);
        let text = std::fs::read_to_string(&config_path).map_err(|source| CheckpointError::Io {
            path: config_path.clone(),
            source,
        })?;
        let config = LlamaConfig::from_json(&text).map_err(|message| CheckpointError::Config {
            path: config_path,
            message,
        })?;
        let mut state = StateDict::new();
        for file in weight_files(dir)? {
            state.extend(checkpoint::load(dir.join(file))?);
        }
        let mut model = Self::from_state_dict(config, state)?;
        model.to(device)?;
        Ok(model)
    }

    /// The model of `config` over the tensors of `state`, named as transformers names them
    /// (see [`Llama::from_pretrained`] for what is checked).
    pub fn from_state_dict(config: LlamaConfig, state: StateDict) -> Result<Self, CheckpointError> {
        let tied = config.tie_word_embeddings;
        let state: StateDict = state
            .into_iter()
            .filter(|(name, _)| {
                !(name.ends_with("rotary_emb.inv_freq") || tied && name == "lm_head.weight")
            })
            .collect();
        let given: HashMap<&str, &Tensor> = state.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let dtype = given
            .get("model.embed_tokens.weight")
            .map_or(DType::F32, |t| t.dtype());
        let mut expected = Vec::new();
        let model = Self::build(config, &mut |name, shape, _: Kind| {
            // What the model expects, as a stand-in of the right shape without memory; it takes
            // the stand-in's place where the file's tensor does not fit, so every problem is
            // found before the check below refuses them all.
            let stand_in = Tensor::zeros(&[1], dtype, Device::Cpu)?.broadcast_to(shape)?;
            let fits = given
                .get(name)
                .filter(|t| t.shape() == shape && t.dtype() == dtype);
            let tensor = fits.map_or_else(|| stand_in.clone(), |t| (*t).clone());
            expected.push((name.to_string(), stand_in));
            Ok(tensor)
        })?;
        check_state("model", &expected, &state)?;
        Ok(model)
    }

    /// Writes `config.json` and `model.safetensors` into `dir` (made if absent), which
    /// transformers' `LlamaForCausalLM.from_pretrained` and [`Llama::from_pretrained`] read.
    pub fn save_pretrained(&self, dir: impl AsRef<Path>) -> Result<(), CheckpointError> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|source| CheckpointError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let config = dir.join(CONFIG);
        let text = serde_json::to_string_pretty(&self.config.to_json()).map_err(|e| {
            CheckpointError::Config {
                path: config.clone(),
                message: e.to_string(),
            }
        })?;
        std::fs::write(&config, text + "\n").map_err(|source| CheckpointError::Io {
            path: config,
            source,
        })?;
        checkpoint::save(dir.join(WEIGHTS), &self.state_dict())?;
        Ok(())
    }
}

/// The safetensors files of `dir`: the shards its index names, else `model.safetensors`.
fn weight_files(dir: &Path) -> Result<Vec<String>, CheckpointError> {
    let index = dir.join(INDEX);
    if !index.exists() {
        return match dir.join(WEIGHTS).exists() {
            true => Ok(vec![WEIGHTS.into()]),
            false => Err(CheckpointError::Config {
                path: dir.to_path_buf(),
                message: format!(
                    "neither {WEIGHTS} nor {INDEX} is here; save the model with save_pretrained (safe_serialization=True)"
                ),
            }),
        };
    }
    let bad = |message: String| CheckpointError::Config {
        path: index.clone(),
        message,
    };
    let text = std::fs::read_to_string(&index).map_err(|source| CheckpointError::Io {
        path: index.clone(),
        source,
    })?;
    let doc: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let map = doc
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
    let files: BTreeSet<String> = map
        .values()
        .map(|f| {
            f.as_str()
                .map(String::from)
                .ok_or_else(|| bad(format!("a shard name must be a string, got {f}")))
        })
        .collect::<Result<_, _>>()?;
    if let Some(outside) = files
        .iter()
        .find(|f| Path::new(f).components().count() != 1)
    {
        return Err(bad(format!(
            "shard {outside:?} is not a file name in this directory"
        )));
    }
    Ok(files.into_iter().collect())
}
