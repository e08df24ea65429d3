//! A small decoder (2 layers, grouped-query attention) in candle ops whose KV cache is a paged
//! cache ([`PagedKvTensors`]): K and V of each new token are written into blocks the cache
//! allocated, attention reads them back through a block table (`index_select`), with the
//! table padded by a block nobody allocated (the zero page: read, never used). The same model
//! over a static cache (K and V kept as ordinary tensors, concatenated per step) must give the
//! same logits bit for bit at every step. Needs a CUDA GPU: `cargo run --release --features
//! candle --example paged_kv_attention`.

use candle_core::{DType, Device, Tensor, D};
use elastic_vmm::candle::{PagedKvTensors, TensorPool};
use elastic_vmm::kv::PagedKvConfig;
use elastic_vmm::Pool;

const LAYERS: usize = 2;
const HEADS: usize = 8;
const KV_HEADS: usize = 2;
const DIM: usize = 64;
const HIDDEN: usize = HEADS * DIM;
const VOCAB: usize = 256;
const BLOCK: usize = 16;
const STEPS: usize = 40;

type R<T> = Result<T, Box<dyn std::error::Error>>;

struct Layer {
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
}

fn weights(dev: &Device) -> R<(Tensor, Vec<Layer>, Tensor)> {
    let w = |r: usize, c: usize| -> R<Tensor> {
        Ok(
            (Tensor::randn(0f32, 1.0, (r, c), &Device::Cpu)? / (r as f64).sqrt())?
                .to_device(dev)?,
        )
    };
    let embed = w(VOCAB, HIDDEN)?;
    let layers = (0..LAYERS)
        .map(|_| {
            Ok(Layer {
                wq: w(HIDDEN, HEADS * DIM)?,
                wk: w(HIDDEN, KV_HEADS * DIM)?,
                wv: w(HIDDEN, KV_HEADS * DIM)?,
                wo: w(HEADS * DIM, HIDDEN)?,
            })
        })
        .collect::<R<Vec<_>>>()?;
    Ok((embed, layers, w(HIDDEN, VOCAB)?))
}

/// Attention of one query token `q` `[HEADS, DIM]` over `k`, `v` `[t, KV_HEADS, DIM]`.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor) -> R<Tensor> {
    let rep = HEADS / KV_HEADS;
    // [KV_HEADS, rep, DIM] x [KV_HEADS, DIM, t] -> [KV_HEADS, rep, t]
    let q = q.reshape((KV_HEADS, rep, DIM))?;
    let kt = k.transpose(0, 1)?.transpose(1, 2)?.contiguous()?;
    let s = (q.matmul(&kt)? / (DIM as f64).sqrt())?;
    let p = candle_nn_softmax(&s)?;
    let vt = v.transpose(0, 1)?.contiguous()?; // [KV_HEADS, t, DIM]
    Ok(p.matmul(&vt)?.reshape((1, HEADS * DIM))?)
}

fn candle_nn_softmax(s: &Tensor) -> R<Tensor> {
    let m = s.max_keepdim(D::Minus1)?;
    let e = s.broadcast_sub(&m)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// Where a decode step's K and V go, and where attention reads them from.
trait Cache {
    fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> R<()>;
    fn read(&self, layer: usize) -> R<(Tensor, Tensor)>;
}

struct Static {
    kv: Vec<Option<(Tensor, Tensor)>>,
}

impl Cache for Static {
    fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> R<()> {
        self.kv[layer] = Some(match self.kv[layer].take() {
            None => (k.clone(), v.clone()),
            Some((ks, vs)) => (Tensor::cat(&[&ks, k], 0)?, Tensor::cat(&[&vs, v], 0)?),
        });
        Ok(())
    }
    fn read(&self, layer: usize) -> R<(Tensor, Tensor)> {
        Ok(self.kv[layer].clone().ok_or("empty")?)
    }
}

struct Paged<'a> {
    cache: &'a PagedKvTensors,
    /// The sequence's block table.
    blocks: Vec<usize>,
    tokens: Vec<usize>,
    /// A block nobody allocated, padding the table (reads zeros, never used).
    pad: usize,
}

impl Cache for Paged<'_> {
    fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> R<()> {
        let t = self.tokens[layer];
        if t / BLOCK == self.blocks.len() {
            self.blocks.extend(self.cache.alloc(1)?);
        }
        let (b, slot) = (self.blocks[t / BLOCK], t % BLOCK);
        for (dst, src) in [(self.cache.k(layer)?, k), (self.cache.v(layer)?, v)] {
            // [1, KV_HEADS, DIM] into token `slot` of block `b`: the flat offset in the tensor.
            let flat = dst.flatten_all()?;
            flat.slice_set(&src.flatten_all()?, 0, (b * BLOCK + slot) * KV_HEADS * DIM)?;
        }
        self.tokens[layer] += 1;
        Ok(())
    }
    fn read(&self, layer: usize) -> R<(Tensor, Tensor)> {
        let t = self.tokens[layer];
        let mut table: Vec<u32> = self.blocks.iter().map(|&b| b as u32).collect();
        table.push(self.pad as u32);
        let idx = Tensor::new(table.as_slice(), self.cache.device())?;
        let gather = |x: Tensor| -> R<Tensor> {
            let g = x.index_select(&idx, 0)?; // [blocks + 1, BLOCK, KV_HEADS, DIM]
            Ok(g.reshape(((self.blocks.len() + 1) * BLOCK, KV_HEADS, DIM))?
                .narrow(0, 0, t)?)
        };
        Ok((gather(self.cache.k(layer)?)?, gather(self.cache.v(layer)?)?))
    }
}

fn step(
    token: u32,
    embed: &Tensor,
    layers: &[Layer],
    head: &Tensor,
    cache: &mut dyn Cache,
) -> R<Tensor> {
    let dev = embed.device();
    let mut x = embed.index_select(&Tensor::new(&[token], dev)?, 0)?; // [1, HIDDEN]
    for (l, w) in layers.iter().enumerate() {
        let q = x.matmul(&w.wq)?.reshape((HEADS, DIM))?;
        let k = x.matmul(&w.wk)?.reshape((1, KV_HEADS, DIM))?;
        let v = x.matmul(&w.wv)?.reshape((1, KV_HEADS, DIM))?;
        cache.append(l, &k, &v)?;
        let (ks, vs) = cache.read(l)?;
        let a = attend(&q, &ks, &vs)?;
        x = (x + a.matmul(&w.wo)?)?;
    }
    Ok(x.matmul(head)?)
}

fn main() -> R<()> {
    let dev = Device::new_cuda(0)?;
    let pool = Pool::cuda(0, 8 << 30)?;
    let tensors = TensorPool::new(&pool, &dev)?;
    let config = PagedKvConfig::new(LAYERS, KV_HEADS, DIM, BLOCK, 4, 1024);
    let cache = PagedKvTensors::new(&tensors, config, DType::F32)?;
    let (embed, layers, head) = weights(&dev)?;
    let mut stat = Static {
        kv: vec![None; LAYERS],
    };
    let mut paged = Paged {
        cache: &cache,
        blocks: Vec::new(),
        tokens: vec![0; LAYERS],
        pad: 1000,
    };
    // Blocks of other sequences first, so this one's blocks are not 0, 1, 2...
    let others = cache.alloc(37)?;
    let mut token = 1u32;
    for s in 0..STEPS {
        let a = step(token, &embed, &layers, &head, &mut stat)?;
        let b = step(token, &embed, &layers, &head, &mut paged)?;
        let (a, b) = (
            a.flatten_all()?.to_vec1::<f32>()?,
            b.flatten_all()?.to_vec1::<f32>()?,
        );
        let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
        if !same {
            return Err(format!("step {s}: logits differ from the static cache").into());
        }
        token = a
            .iter()
            .enumerate()
            .max_by(|x, y| x.1.total_cmp(y.1))
            .map_or(0, |(i, _)| i as u32);
    }
    println!(
        "{STEPS} decode steps: logits equal to the static cache bit for bit; blocks {:?}, cache {:?}",
        paged.blocks,
        cache.stats()
    );
    cache.free(&paged.blocks)?;
    cache.free(&others)?;
    Ok(())
}
