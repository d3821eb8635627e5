// Package amqptest gives each test a vhost of its own on the real RabbitMQ
// (127.0.0.1:5672 by default), so tests run in parallel and never touch
// another vhost's data. It creates and deletes vhosts with rabbitmqctl
// (scripts/ensure-rabbitmq.sh installs and starts the broker on a fresh
// machine); it never restarts or reconfigures the broker.
package amqptest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/fifobox/fifobox/pkg/redact"
)

// DefaultURL is the broker tests use when FIFOBOX_TEST_AMQP_URL is unset;
// its vhost part is replaced by each test's own.
const DefaultURL = "amqp://guest:guest@127.0.0.1:5672/"

// Vhost is one test's vhost.
type Vhost struct {
	// Name of the vhost.
	Name string
	// URL connects to it.
	URL string
}

// New creates a fresh vhost granting the URL's user everything, and deletes
// it (with every queue in it) when the test ends.
func New(tb testing.TB) *Vhost {
	tb.Helper()
	base := os.Getenv("FIFOBOX_TEST_AMQP_URL")
	if base == "" {
		base = DefaultURL
	}
	u, err := url.Parse(base)
	if err != nil {
		tb.Fatalf("amqptest: FIFOBOX_TEST_AMQP_URL: %v", redact.Error(err, base))
	}
	if c, err := net.DialTimeout("tcp", u.Host, 3*time.Second); err != nil {
		tb.Fatalf("amqptest: RabbitMQ does not answer on %s: %v (run scripts/ensure-rabbitmq.sh)", u.Host, err)
	} else {
		c.Close()
	}
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	name := "fifobox-test-" + hex.EncodeToString(b)
	user := u.User.Username()
	if user == "" {
		user = "guest"
	}
	Ctl(tb, "add_vhost", name)
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if out, err := exec.CommandContext(ctx, "rabbitmqctl", "-q", "delete_vhost", name).CombinedOutput(); err != nil {
			tb.Logf("amqptest: delete vhost %s: %v: %s", name, err, out)
		}
	})
	Ctl(tb, "set_permissions", "-p", name, user, ".*", ".*", ".*")
	u.Path = "/" + name
	return &Vhost{Name: name, URL: u.String()}
}

// CloseConnections closes every client connection to the vhost, as a broker
// outage or a network cut would, and returns how many it closed.
func (v *Vhost) CloseConnections(tb testing.TB) int {
	tb.Helper()
	n := len(v.Connections(tb))
	Ctl(tb, "close_all_connections", "-p", v.Name, "fifobox test: simulated outage")
	return n
}

// Connections lists the client-provided names of the vhost's connections.
func (v *Vhost) Connections(tb testing.TB) []string {
	tb.Helper()
	var out []string
	for _, m := range connNameRE.FindAllStringSubmatch(Ctl(tb, "--no-table-headers", "list_connections", "-p", v.Name, "client_properties"), -1) {
		out = append(out, m[1])
	}
	return out
}

var connNameRE = regexp.MustCompile(`\{"connection_name","([^"]*)"\}`)

// Ctl runs rabbitmqctl with args and fails the test if it fails.
func Ctl(tb testing.TB, args ...string) string {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "rabbitmqctl", append([]string{"-q"}, args...)...).CombinedOutput()
	if err != nil {
		tb.Fatalf("amqptest: rabbitmqctl %s: %v: %s (needs the broker's Erlang cookie: run as root or the rabbitmq user)", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// String is the vhost's name.
func (v *Vhost) String() string { return fmt.Sprintf("vhost %s", v.Name) }
