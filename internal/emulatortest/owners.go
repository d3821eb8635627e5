package emulatortest

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// An emulator the tests start must not outlive them, but many test binaries
// (one per package, run in parallel by `go test ./...`) share it. So it is
// owned by the `go test` commands using it: each registers its pid as a
// file in the owners directory, and the emulator (localstack/launcher.mjs)
// exits once none of them is alive. Registration and that check take the
// same lock (a directory, which Node and Go can both create atomically), so
// no test registers with an emulator that is about to exit. Emulators
// started any other way (make local, make test, by hand) have no owners and
// are never stopped by the tests.

// ownersDir is machine-wide, not per checkout: two checkouts sharing a port
// share the emulator.
func ownersDir(port int) string {
	return filepath.Join(os.TempDir(), fmt.Sprintf("fifobox-emulator-%d.owners", port))
}

// owner is the pid whose life bounds the emulator's: the `go` command that
// runs this test binary (all packages of one `go test ./...` share it), or
// the test binary itself when run some other way.
func owner() int {
	ppid := os.Getppid()
	if comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", ppid)); err == nil && strings.TrimSpace(string(comm)) == "go" {
		return ppid
	}
	return os.Getpid()
}

func register(port int) error {
	dir := ownersDir(port)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, strconv.Itoa(owner())), nil, 0o644)
}

// withLock runs fn holding the owners lock of port (see launcher.mjs). A
// lock left by a dead process is broken.
func withLock(port int, fn func() error) error {
	lock := ownersDir(port) + ".lock"
	deadline := time.Now().Add(time.Minute)
	for {
		err := os.Mkdir(lock, 0o755)
		if err == nil {
			break
		}
		if !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("emulator lock: %w", err)
		}
		if stale(lock) {
			_ = os.RemoveAll(lock)
			continue
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("emulator lock %s held for a minute", lock)
		}
		time.Sleep(50 * time.Millisecond)
	}
	defer os.RemoveAll(lock)
	if err := os.WriteFile(filepath.Join(lock, "pid"), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		return err
	}
	return fn()
}

// stale: the lock's holder is gone (or never wrote its pid, long ago).
func stale(lock string) bool {
	b, err := os.ReadFile(filepath.Join(lock, "pid"))
	if err != nil {
		st, serr := os.Stat(lock)
		return serr == nil && time.Since(st.ModTime()) > 10*time.Second
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	return err != nil || !alive(pid)
}

func alive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}
