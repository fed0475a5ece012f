from fakes.runner import ScriptedRunner, recorded

from cudadoctor.probes._fs import Root
from cudadoctor.probes.host import detect_container, detect_wsl, probe_host


def test_ubuntu_docker_tree(tree):
    root = tree({
        "/etc/os-release": recorded("os-release-ubuntu2204.txt"),
        "/proc/version": recorded("proc-version-ubuntu2204.txt"),
        "/proc/sys/kernel/osrelease": "5.15.0-105-generic\n",
        "/.dockerenv": "",
    })
    runner = ScriptedRunner([(("ldd", "--version"), recorded("ldd-version-ubuntu2204.txt"))])
    host = probe_host(runner, Root(str(root)), {})
    assert host["distro"] == "Ubuntu 22.04"
    assert host["distro_id"] == "ubuntu"
    assert host["glibc"] == "2.35"
    assert host["kernel"] == "5.15.0-105-generic"
    assert host["wsl"] is None
    assert host["container"] == "docker"
    assert host["container_hints"] == ["/.dockerenv"]


def test_debian_os_release_recorded(tree):
    root = tree({"/etc/os-release": recorded("os-release-debian12.txt")})
    host = probe_host(ScriptedRunner(), Root(str(root)), {})
    assert host["distro"] == "Debian GNU/Linux 12"
    assert host["glibc"] is None  # no ldd answer in a fake tree: unknown, not a crash


def test_wsl2_from_proc_version(tree):
    root = tree({"/proc/version": recorded("proc-version-wsl2.txt")}, dirs=["/usr/lib/wsl/lib"])
    wsl, hints = detect_wsl(Root(str(root)), recorded("proc-version-wsl2.txt"), None, {})
    assert wsl == 2
    assert "/usr/lib/wsl" in hints


def test_wsl2_from_dev_dxg_only(tree):
    root = tree({"/dev/dxg": ""})
    assert detect_wsl(Root(str(root)), "Linux version 6.6.0 (custom)", "6.6.0", {})[0] == 2


def test_wsl1_kernel(tree):
    root = tree({"/proc/version": recorded("proc-version-wsl1.txt")})
    assert detect_wsl(Root(str(root)), recorded("proc-version-wsl1.txt"), "4.4.0-19041-Microsoft", {})[0] == 1


def test_not_wsl(tree):
    root = tree({})
    assert detect_wsl(Root(str(root)), recorded("proc-version-ubuntu2204.txt"), None, {}) == (None, [])


def test_wsl2_probe_host_reads_kernel(tree):
    root = tree({
        "/proc/version": recorded("proc-version-wsl2.txt"),
        "/proc/sys/kernel/osrelease": "5.15.153.1-microsoft-standard-WSL2\n",
        "/dev/dxg": "",
    })
    host = probe_host(ScriptedRunner(), Root(str(root)), {})
    assert host["wsl"] == 2
    assert host["kernel"] == "5.15.153.1-microsoft-standard-WSL2"
    assert host["dev_dxg"] is True


def test_podman(tree):
    root = tree({"/run/.containerenv": ""})
    assert detect_container(Root(str(root)), {})[0] == "podman"


def test_kubernetes_env_wins_over_dockerenv(tree):
    root = tree({"/.dockerenv": ""})
    kind, hints = detect_container(Root(str(root)), {"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    assert kind == "kubernetes"
    assert "/.dockerenv" in hints


def test_kubernetes_from_cgroup(tree):
    root = tree({"/proc/1/cgroup": recorded("proc-1-cgroup-kubepods-v1.txt")})
    assert detect_container(Root(str(root)), {})[0] == "kubernetes"


def test_bare_metal(tree):
    root = tree({"/proc/1/cgroup": "0::/init.scope\n"})
    assert detect_container(Root(str(root)), {}) == (None, [])
