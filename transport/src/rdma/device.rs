//! Which RDMA device to use: one named, the one nearest a GPU on the PCIe tree, or the first
//! with an active port.
//!
//! Nearness is the number of hops between the two functions in the sysfs device tree
//! (`/sys/class/infiniband/<dev>/device` and `/sys/bus/pci/devices/<gpu bus id>`, both
//! resolved): a NIC behind the same PCIe switch as the GPU is 2 hops away, one behind another
//! root port of the same socket more, one on the other socket most. GPUDirect RDMA wants the
//! nearest (traffic through the CPU's root complex, or across sockets, is slow or refused).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// How the device is picked.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// The first device found.
    #[default]
    First,
    /// The device of this name (`mlx5_0`).
    Named(String),
    /// The device nearest the GPU at this PCI address (`0000:3b:00.0`).
    NearGpu(String),
}

/// A device found, with where it sits on the PCIe tree (if sysfs says).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Its name.
    pub name: String,
    /// Its resolved sysfs device path.
    pub pci_path: Option<PathBuf>,
}

/// Hops between two sysfs device paths (up from one to their common ancestor, down to the
/// other).
pub fn pci_hops(a: &Path, b: &Path) -> usize {
    let a: Vec<_> = a.components().collect();
    let b: Vec<_> = b.components().collect();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    (a.len() - common) + (b.len() - common)
}

/// The resolved sysfs path of an RDMA device.
pub fn sysfs_path_of_device(name: &str) -> Option<PathBuf> {
    std::fs::canonicalize(Path::new("/sys/class/infiniband").join(name).join("device")).ok()
}

/// The resolved sysfs path of a PCI function (`0000:3b:00.0`).
pub fn sysfs_path_of_pci(bus_id: &str) -> Option<PathBuf> {
    std::fs::canonicalize(Path::new("/sys/bus/pci/devices").join(bus_id.to_lowercase())).ok()
}

/// Pick among `found` (in the order the verbs library listed them). `gpu_path` is the
/// resolved sysfs path of the GPU for [`DeviceChoice::NearGpu`].
///
/// # Errors
/// [`Error::NotFound`] when nothing fits, saying what there is.
pub fn choose<'a>(
    found: &'a [Found],
    choice: &DeviceChoice,
    gpu_path: Option<&Path>,
) -> Result<&'a Found> {
    let names = || {
        if found.is_empty() {
            "no RDMA devices (is rdma-core installed and a NIC's driver loaded? `ibv_devices` lists them)"
                .to_string()
        } else {
            format!(
                "devices here: {}",
                found
                    .iter()
                    .map(|f| f.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    };
    match choice {
        DeviceChoice::First => found.first().ok_or_else(|| Error::NotFound(names())),
        DeviceChoice::Named(n) => found
            .iter()
            .find(|f| &f.name == n)
            .ok_or_else(|| Error::NotFound(format!("no RDMA device {n}; {}", names()))),
        DeviceChoice::NearGpu(bus) => {
            let gpu = gpu_path.ok_or_else(|| {
                Error::NotFound(format!(
                    "no PCI function {bus} in /sys/bus/pci/devices (the GPU's bus id, as `nvidia-smi --query-gpu=pci.bus_id` prints it)"
                ))
            })?;
            found
                .iter()
                .filter_map(|f| f.pci_path.as_deref().map(|p| (pci_hops(p, gpu), f)))
                .min_by_key(|&(hops, _)| hops)
                .map(|(_, f)| f)
                .ok_or_else(|| {
                    Error::NotFound(format!("no RDMA device with a PCI path; {}", names()))
                })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(name: &str, path: &str) -> Found {
        Found {
            name: name.into(),
            pci_path: Some(PathBuf::from(path)),
        }
    }

    #[test]
    fn the_nic_behind_the_gpus_switch_is_chosen_over_one_across_the_socket() {
        let found = [
            f(
                "mlx5_0",
                "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0",
            ),
            f(
                "mlx5_1",
                "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:08.0/0000:3e:00.0",
            ),
            f(
                "mlx5_2",
                "/sys/devices/pci0000:3a/0000:3a:02.0/0000:40:00.0",
            ),
        ];
        let gpu = PathBuf::from(
            "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:04.0/0000:3d:00.0",
        );
        let near = DeviceChoice::NearGpu("0000:3d:00.0".into());
        assert_eq!(choose(&found, &near, Some(&gpu)).unwrap().name, "mlx5_1");
        assert_eq!(pci_hops(found[1].pci_path.as_ref().unwrap(), &gpu), 4);
        assert!(pci_hops(found[2].pci_path.as_ref().unwrap(), &gpu) > 4);
        assert!(
            pci_hops(found[0].pci_path.as_ref().unwrap(), &gpu)
                > pci_hops(found[2].pci_path.as_ref().unwrap(), &gpu)
        );
    }

    #[test]
    fn a_name_or_the_first_is_taken_and_a_miss_says_what_there_is() {
        let found = [f("mlx5_0", "/a/b"), f("mlx5_1", "/a/c")];
        assert_eq!(
            choose(&found, &DeviceChoice::First, None).unwrap().name,
            "mlx5_0"
        );
        assert_eq!(
            choose(&found, &DeviceChoice::Named("mlx5_1".into()), None)
                .unwrap()
                .name,
            "mlx5_1"
        );
        let e = choose(&found, &DeviceChoice::Named("irdma0".into()), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("mlx5_0, mlx5_1"), "{e}");
        let e = choose(&[], &DeviceChoice::First, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no RDMA devices"), "{e}");
        let e = choose(&found, &DeviceChoice::NearGpu("0000:99:00.0".into()), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("nvidia-smi"), "{e}");
    }
}
