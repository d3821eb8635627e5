package pgtest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Private cluster ports: the range the machine's shared services leave free
// for throw-away clusters.
const (
	privatePortLow  = 55400
	privatePortHigh = 55499
)

// StartCluster initialises and starts a private PostgreSQL cluster in a
// temporary directory, with the given extra server settings (e.g.
// "autovacuum=on"), and stops and deletes it when the test ends. It returns
// the URL of its postgres database (trust auth, user postgres). Meant for
// measurements the shared server cannot give (its autovacuum is off), e.g.
// dead tuples under a long transaction. As root, the server runs as the
// postgres user. The test is skipped if no PostgreSQL binaries are found.
func StartCluster(tb testing.TB, settings ...string) string {
	tb.Helper()
	bin := postgresBinDir()
	if bin == "" {
		tb.Skip("pgtest: no PostgreSQL server binaries (initdb, pg_ctl) found")
	}
	dir, err := os.MkdirTemp("", "fifobox-pgcluster-")
	if err != nil {
		tb.Fatalf("pgtest: cluster dir: %v", err)
	}
	cred := serverCredential(tb)
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			tb.Fatalf("pgtest: chown cluster dir: %v", err)
		}
	}
	run := func(name string, args ...string) error {
		cmd := exec.Command(filepath.Join(bin, name), args...)
		cmd.Dir = dir
		if cred != nil {
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
		}
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s: %w: %s", name, err, strings.TrimSpace(string(out)))
		}
		return nil
	}
	data := filepath.Join(dir, "data")
	if err := run("initdb", "-D", data, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"); err != nil {
		os.RemoveAll(dir)
		tb.Fatalf("pgtest: %v", err)
	}
	port := freePort(tb)
	opts := []string{"-p " + strconv.Itoa(port), "-c listen_addresses=127.0.0.1", "-c unix_socket_directories=" + dir}
	for _, s := range settings {
		opts = append(opts, "-c "+s)
	}
	if err := run("pg_ctl", "-D", data, "-o", strings.Join(opts, " "), "-l", filepath.Join(dir, "server.log"), "-w", "-t", "60", "start"); err != nil {
		os.RemoveAll(dir)
		tb.Fatalf("pgtest: %v", err)
	}
	tb.Cleanup(func() {
		if err := run("pg_ctl", "-D", data, "-m", "fast", "-w", "stop"); err != nil {
			tb.Logf("pgtest: stop private cluster: %v", err)
		}
		os.RemoveAll(dir)
	})
	url := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		tb.Fatalf("pgtest: connect to private cluster: %v", err)
	}
	c.Close(ctx)
	return url
}

// postgresBinDir finds the newest /usr/lib/postgresql/N/bin with initdb, or
// initdb on PATH.
func postgresBinDir() string {
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool {
		vi, _ := strconv.Atoi(filepath.Base(filepath.Dir(dirs[i])))
		vj, _ := strconv.Atoi(filepath.Base(filepath.Dir(dirs[j])))
		return vi > vj
	})
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		return filepath.Dir(p)
	}
	return ""
}

// serverCredential is the postgres user's when running as root (PostgreSQL
// refuses to run as root), nil otherwise.
func serverCredential(tb testing.TB) *syscall.Credential {
	if os.Geteuid() != 0 {
		return nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		tb.Skipf("pgtest: running as root and no postgres user to run a private cluster as: %v", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
}

// freePort picks a free port of the private range, starting at a point that
// depends on the process id so parallel runs rarely collide.
func freePort(tb testing.TB) int {
	n := privatePortHigh - privatePortLow + 1
	start := os.Getpid() % n
	for i := 0; i < n; i++ {
		port := privatePortLow + (start+i)%n
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			continue
		}
		l.Close()
		return port
	}
	tb.Fatalf("pgtest: no free port in %d-%d", privatePortLow, privatePortHigh)
	return 0
}

// NewIn creates a fresh migrated schema in the database at url (e.g. a
// private cluster's), like New, dropped when the test ends.
func NewIn(tb testing.TB, url string) *DB {
	tb.Helper()
	return newSchema(tb, url, true)
}
