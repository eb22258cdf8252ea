//! A Llama's size and options, read from and written to transformers' `config.json`.

use serde_json::{Map, Value, json};

use crate::nn::RopeScaling;

/// The size and options of a [`Llama`](super::Llama), named as transformers' `LlamaConfig`
/// names them.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Distinct tokens.
    pub vocab_size: usize,
    /// The width of the residual stream.
    pub hidden_size: usize,
    /// The width of the gated MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads per layer.
    pub num_attention_heads: usize,
    /// Key and value heads per layer, dividing `num_attention_heads` (fewer: grouped-query
    /// attention).
    pub num_key_value_heads: usize,
    /// The width of each head (`hidden_size / num_attention_heads` unless given).
    pub head_dim: usize,
    /// Added to the mean square in each RMSNorm.
    pub rms_norm_eps: f64,
    /// The base of the rotary frequencies.
    pub rope_theta: f64,
    /// How the rotary frequencies are stretched.
    pub rope_scaling: RopeScaling,
    /// The longest sequence the model takes.
    pub max_position_embeddings: usize,
    /// Whether the output head is the token embedding itself.
    pub tie_word_embeddings: bool,
    /// Whether the attention's projections have biases.
    pub attention_bias: bool,
    /// Whether the MLP's projections have biases.
    pub mlp_bias: bool,
}

impl LlamaConfig {
    /// The project's ~1 B Llama (0.97 B parameters): 19 layers of 2048, MLP 5632, 32 query
    /// heads and 4 key/value heads of 64, vocabulary 32,000, context 2048.
    pub fn llama_1b() -> Self {
        Self::new(32_000, 2048, 5632, 19, 32, 4)
    }

    /// A configuration with transformers' defaults for everything but the sizes given.
    pub fn new(
        vocab_size: usize,
        hidden_size: usize,
        intermediate_size: usize,
        num_hidden_layers: usize,
        num_attention_heads: usize,
        num_key_value_heads: usize,
    ) -> Self {
        Self {
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim: hidden_size / num_attention_heads.max(1),
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            rope_scaling: RopeScaling::None,
            max_position_embeddings: 2048,
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
        }
    }

    /// Why this configuration cannot make a model, if it cannot.
    pub fn check(&self) -> Result<(), String> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, n)| *n == 0) {
            return Err(format!("{name} must be at least 1"));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(format!(
                "num_key_value_heads ({}) must divide num_attention_heads ({})",
                self.num_key_value_heads, self.num_attention_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim must be even for rotary embeddings, got {}",
                self.head_dim
            ));
        }
        Ok(())
    }

    /// Parameters of the model this configuration makes.
    pub fn parameters(&self) -> usize {
        let (h, hd) = (self.hidden_size, self.head_dim);
        let (q, kv) = (self.num_attention_heads * hd, self.num_key_value_heads * hd);
        let attention = h * q
            + 2 * h * kv
            + q * h
            + if self.attention_bias {
                q + 2 * kv + h
            } else {
                0
            };
        let i = self.intermediate_size;
        let mlp = 3 * h * i + if self.mlp_bias { 2 * i + h } else { 0 };
        let layer = attention + mlp + 2 * h;
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * h
        };
        self.vocab_size * h + self.num_hidden_layers * layer + h + head
    }

    /// Reads transformers' `config.json` text. Keys it does not need are ignored; a Llama
    /// option ferry does not implement (an activation other than SiLU, a rope scaling other
    /// than Llama 3's) is an error naming it.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let doc: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let map = doc.as_object().ok_or("not a JSON object")?;
        let size = |key: &str| -> Result<usize, String> {
            let v = map.get(key).ok_or(format!("no \"{key}\""))?;
            v.as_u64()
                .map(|n| n as usize)
                .ok_or(format!("\"{key}\" must be a whole number, got {v}"))
        };
        let optional = |key: &str, default: usize| match map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(_) => size(key),
        };
        let flag = |key: &str| map.get(key).and_then(Value::as_bool).unwrap_or(false);
        let number = |map: &Map<String, Value>, key: &str, default: f64| match map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or(format!("\"{key}\" must be a number, got {v}")),
        };
        if let Some(act) = map.get("hidden_act").and_then(Value::as_str)
            && act != "silu"
        {
            return Err(format!(
                "\"hidden_act\": \"{act}\" is not supported; ferry's Llama uses SiLU"
            ));
        }
        let vocab_size = size("vocab_size")?;
        let hidden = size("hidden_size")?;
        let intermediate_size = size("intermediate_size")?;
        let num_hidden_layers = size("num_hidden_layers")?;
        let heads = size("num_attention_heads")?;
        // Newer transformers keep the rotary settings in "rope_parameters".
        let rope = match map
            .get("rope_parameters")
            .or_else(|| map.get("rope_scaling"))
        {
            Some(Value::Object(rope)) => Some(rope),
            _ => None,
        };
        let theta = match rope.filter(|r| r.contains_key("rope_theta")) {
            Some(rope) => number(rope, "rope_theta", 10_000.0)?,
            None => number(map, "rope_theta", 10_000.0)?,
        };
        let config = Self {
            vocab_size,
            hidden_size: hidden,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: optional("num_key_value_heads", heads)?,
            head_dim: optional("head_dim", hidden / heads.max(1))?,
            rms_norm_eps: number(map, "rms_norm_eps", 1e-6)?,
            rope_theta: theta,
            rope_scaling: rope.map_or(Ok(RopeScaling::None), rope_scaling)?,
            max_position_embeddings: optional("max_position_embeddings", 2048)?,
            tie_word_embeddings: flag("tie_word_embeddings"),
            attention_bias: flag("attention_bias"),
            mlp_bias: flag("mlp_bias"),
        };
        config.check()?;
        Ok(config)
    }

    /// transformers' `config.json` for this configuration (`LlamaConfig.from_dict` reads it).
    pub fn to_json(&self) -> Value {
        let scaling = match self.rope_scaling {
            RopeScaling::None => Value::Null,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context,
            } => json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_context,
            }),
        };
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
        })
    }
}

/// `rope_scaling` (or `rope_parameters`): none, the default, or Llama 3's.
fn rope_scaling(rope: &Map<String, Value>) -> Result<RopeScaling, String> {
    let kind = rope
        .get("rope_type")
        .or_else(|| rope.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let number = |key: &str| {
        rope.get(key)
            .and_then(Value::as_f64)
            .ok_or(format!("rope scaling \"{kind}\" needs a number \"{key}\""))
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_context: number("original_max_position_embeddings")? as usize,
        }),
        other => Err(format!(
            "rope scaling \"{other}\" is not supported; ferry's Llama takes none or \"llama3\""
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_one_billion_config_has_its_parameter_count() {
        let config = LlamaConfig::llama_1b();
        assert_eq!(config.head_dim, 64);
        // 2 x 32000 x 2048 + 19 x (attention 2048 x (2048 + 2 x 256 + 2048) + MLP 3 x 2048 x
        // 5632 + two norms) + the final norm.
        assert_eq!(config.parameters(), 967_915_520);
        assert_eq!(config.check(), Ok(()));
    }

    #[test]
    fn transformers_keys_round_trip_and_defaults_fill_the_rest() {
        let mut config = LlamaConfig::new(100, 32, 64, 2, 4, 2);
        config.tie_word_embeddings = true;
        config.rope_scaling = RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 8192,
        };
        let text = config.to_json().to_string();
        assert_eq!(LlamaConfig::from_json(&text), Ok(config));
        let minimal = r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "torch_dtype": "float32"}"#;
        let read = LlamaConfig::from_json(minimal).unwrap();
        assert_eq!(read, LlamaConfig::new(10, 8, 16, 1, 2, 2));
    }

    #[test]
    fn newer_rope_parameters_are_read_too() {
        let text = r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}"#;
        let read = LlamaConfig::from_json(text).unwrap();
        assert_eq!(
            (read.rope_theta, read.rope_scaling),
            (500_000.0, RopeScaling::None)
        );
    }

    #[test]
    fn what_ferry_does_not_implement_is_named() {
        let base = r#""vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2"#;
        let err = |extra: &str| LlamaConfig::from_json(&format!("{{{base}{extra}}}")).unwrap_err();
        assert!(err(r#", "hidden_act": "gelu""#).contains("\"gelu\" is not supported"));
        assert!(
            err(r#", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}"#).contains("\"yarn\"")
        );
        assert!(err(r#", "num_key_value_heads": 3"#).contains("must divide"));
        assert!(err(r#", "head_dim": 3"#).contains("even"));
        assert!(
            LlamaConfig::from_json("{}")
                .unwrap_err()
                .contains("\"vocab_size\"")
        );
        assert!(
            LlamaConfig::from_json("[1]")
                .unwrap_err()
                .contains("object")
        );
    }
}
