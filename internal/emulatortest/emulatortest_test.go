package emulatortest

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
)

// listening returns the local addresses listening on TCP port, from
// /proc/net/tcp and tcp6 (what `ss -ltn` reads).
func listening(t *testing.T, port int) []string {
	t.Helper()
	var out []string
	for _, file := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		f, err := os.Open(file)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			if len(fields) < 4 || fields[3] != "0A" { // 0A: LISTEN
				continue
			}
			host, p, ok := strings.Cut(fields[1], ":")
			if n, err := strconv.ParseUint(p, 16, 32); !ok || err != nil || int(n) != port {
				continue
			}
			raw, err := hex.DecodeString(host)
			if err != nil {
				continue
			}
			// The kernel prints each 32-bit word in host (little-endian) order.
			for i := 0; i+4 <= len(raw); i += 4 {
				raw[i], raw[i+1], raw[i+2], raw[i+3] = raw[i+3], raw[i+2], raw[i+1], raw[i]
			}
			out = append(out, net.IP(raw).String())
		}
		f.Close()
	}
	return out
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func skipUnlessLinuxEmulator(t *testing.T) {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("reads /proc")
	}
	if os.Getenv("FIFOBOX_SKIP_EMULATOR") == "1" {
		t.Skip("FIFOBOX_SKIP_EMULATOR=1")
	}
}

// The emulator is reachable from this machine only: fauxqs 2.4.1 listens
// on 0.0.0.0 whatever it is told, and the launcher must keep it on loopback.
func TestEmulatorListensOnLoopbackOnly(t *testing.T) {
	skipUnlessLinuxEmulator(t)
	p := StartProcess(t)
	addrs := listening(t, p.Port)
	if len(addrs) == 0 {
		t.Fatalf("nothing listens on port %d", p.Port)
	}
	for _, a := range addrs {
		if a != "127.0.0.1" {
			t.Errorf("emulator listens on %s:%d, want 127.0.0.1 only (all: %v)", a, p.Port, addrs)
		}
	}
}

// TestHelperUser is not a test: the emulator tests below run it in a child
// process as a `go test` would use the emulator (FIFOBOX_EMULATOR_HELPER=1),
// holding it until its stdin closes.
func TestHelperUser(t *testing.T) {
	if os.Getenv("FIFOBOX_EMULATOR_HELPER") != "1" {
		t.Skip("helper process for the emulator ownership tests")
	}
	fmt.Println("endpoint", Endpoint(t))
	_, _ = io.Copy(io.Discard, os.Stdin)
}

// user is a child process using the emulator on port through Endpoint.
type user struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	out    *strings.Builder // its stderr: complete once exit returns
	exited bool
}

func startUser(t *testing.T, port int) *user {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperUser$", "-test.v")
	env := []string{"FIFOBOX_EMULATOR_HELPER=1", fmt.Sprintf("FIFOBOX_EMULATOR_PORT=%d", port)}
	for _, kv := range os.Environ() {
		// Endpoint would use these instead of starting an emulator.
		if !strings.HasPrefix(kv, "FIFOBOX_TEST_AWS_ENDPOINT=") && !strings.HasPrefix(kv, "AWS_ENDPOINT_URL=") &&
			!strings.HasPrefix(kv, "FIFOBOX_EMULATOR_PORT=") {
			env = append(env, kv)
		}
	}
	cmd.Env = env
	u := &user{cmd: cmd, out: &strings.Builder{}}
	var err error
	if u.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = u.out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if !u.exited {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "endpoint ") {
			go func() { _, _ = io.Copy(io.Discard, stdout) }()
			return u
		}
	}
	_ = cmd.Wait()
	t.Fatalf("helper got no endpoint:\n%s", u.out)
	return nil
}

// exit ends the helper and returns what it wrote to stderr (Endpoint's
// note of which emulator it used).
func (u *user) exit(t *testing.T) string {
	t.Helper()
	u.stdin.Close()
	err := u.cmd.Wait()
	u.exited = true
	if err != nil {
		t.Fatalf("helper: %v\n%s", err, u.out)
	}
	return u.out.String()
}

func gone(port int, within time.Duration) bool {
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		if !healthy(fmt.Sprintf("http://127.0.0.1:%d", port)) {
			return true
		}
		time.Sleep(200 * time.Millisecond)
	}
	return false
}

// An emulator the tests start stops when the last process using it ends,
// not before; a second user joins it rather than starting another.
func TestStartedEmulatorStopsWithItsLastUser(t *testing.T) {
	skipUnlessLinuxEmulator(t)
	port := freePort(t)
	t.Cleanup(func() {
		_ = os.Remove(filepath.Join(RepoRoot(), "localstack", fmt.Sprintf(".emulator-%d.log", port)))
		if !gone(port, 0) {
			stopByPidfile(t, port)
		}
	})
	a := startUser(t, port)
	b := startUser(t, port)
	if out := a.exit(t); !strings.Contains(out, "started fauxqs") {
		t.Fatalf("first user did not start the emulator:\n%s", out)
	}
	if gone(port, 3*time.Second) {
		t.Fatalf("the emulator stopped while a user was still running")
	}
	if out := b.exit(t); !strings.Contains(out, "using the emulator tests started") {
		t.Errorf("second user did not join the first one's emulator:\n%s", out)
	}
	if !gone(port, 10*time.Second) {
		t.Fatalf("the emulator is still running 10 s after its last user ended")
	}
	// The launcher removes its pidfile as it exits. A health check can also
	// fail on a loaded machine while the emulator still runs, so give the
	// exit the same 10 s rather than reading the file at once.
	pidfile := filepath.Join(RepoRoot(), "localstack", fmt.Sprintf(".emulator-%d.pid", port))
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		if _, err := os.Stat(pidfile); err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("the stopped emulator left its pidfile")
			break
		}
	}
}

// An emulator the tests did not start (make local, make test, the shared
// one) is used but never stopped by them.
func TestForeignEmulatorIsNeverStopped(t *testing.T) {
	skipUnlessLinuxEmulator(t)
	port := freePort(t)
	script := filepath.Join(RepoRoot(), "localstack", "emulator.sh")
	start := exec.Command(script, "start")
	start.Env = append(os.Environ(), fmt.Sprintf("FIFOBOX_EMULATOR_PORT=%d", port))
	if out, err := start.CombinedOutput(); err != nil {
		t.Fatalf("emulator.sh start: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		stopByPidfile(t, port)
		_ = os.Remove(filepath.Join(RepoRoot(), "localstack", fmt.Sprintf(".emulator-%d.log", port)))
	})
	u := startUser(t, port)
	if out := u.exit(t); !strings.Contains(out, "already running") {
		t.Errorf("user did not use the running emulator:\n%s", out)
	}
	if gone(port, 3*time.Second) {
		t.Fatalf("a test stopped an emulator it did not start")
	}
}

func stopByPidfile(t *testing.T, port int) {
	t.Helper()
	stop := exec.Command(filepath.Join(RepoRoot(), "localstack", "emulator.sh"), "stop")
	stop.Env = append(os.Environ(), fmt.Sprintf("FIFOBOX_EMULATOR_PORT=%d", port))
	if out, err := stop.CombinedOutput(); err != nil {
		t.Errorf("emulator.sh stop: %v\n%s", err, out)
	}
}
