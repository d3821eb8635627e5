// Package amqptest gives each test a vhost of its own on the real RabbitMQ
// (127.0.0.1:5672 by default), so tests run in parallel and never touch
// another vhost's data. It creates and deletes vhosts through the broker's
// management API (http://<host>:15672, the URL's user), or with rabbitmqctl
// where that API does not answer (scripts/ensure-rabbitmq.sh installs and
// starts the broker on a fresh machine and enables the API); it never
// restarts or reconfigures the broker.
package amqptest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/fifobox/fifobox/pkg/redact"
	"github.com/fifobox/fifobox/pkg/transport/amqp/internal/mgmtapi"
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

// baseURL is FIFOBOX_TEST_AMQP_URL, else DefaultURL.
func baseURL() string {
	if b := os.Getenv("FIFOBOX_TEST_AMQP_URL"); b != "" {
		return b
	}
	return DefaultURL
}

// New creates a fresh vhost granting the URL's user everything, and deletes
// it (with every queue in it) when the test ends.
func New(tb testing.TB) *Vhost {
	tb.Helper()
	base := baseURL()
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
	// The API takes ~20 ms a call; rabbitmqctl boots an Erlang VM for each
	// (~0.5 s and a core's worth of CPU), three times per test.
	api := newManagement(u)
	if !api.up() {
		api = nil
	}
	if api != nil {
		api.must(tb, http.MethodPut, "/api/vhosts/"+url.PathEscape(name), nil)
	} else {
		Ctl(tb, "add_vhost", name)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if api != nil {
			if err := api.Do(ctx, http.MethodDelete, "/api/vhosts/"+url.PathEscape(name), nil, nil); err != nil {
				tb.Logf("amqptest: delete vhost %s: %v", name, err)
			}
			return
		}
		if out, err := exec.CommandContext(ctx, "rabbitmqctl", "-q", "delete_vhost", name).CombinedOutput(); err != nil {
			tb.Logf("amqptest: delete vhost %s: %v: %s", name, err, out)
		}
	})
	if api != nil {
		api.must(tb, http.MethodPut, "/api/permissions/"+url.PathEscape(name)+"/"+url.PathEscape(user),
			map[string]string{"configure": ".*", "write": ".*", "read": ".*"})
	} else {
		Ctl(tb, "set_permissions", "-p", name, user, ".*", ".*", ".*")
	}
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

// DeleteUser deletes a broker user (the management API, else rabbitmqctl).
func DeleteUser(tb testing.TB, name string) {
	tb.Helper()
	u, err := url.Parse(baseURL())
	if err != nil {
		tb.Fatalf("amqptest: FIFOBOX_TEST_AMQP_URL: %v", err)
	}
	if api := newManagement(u); api.up() {
		api.must(tb, http.MethodDelete, "/api/users/"+url.PathEscape(name), nil)
		return
	}
	Ctl(tb, "delete_user", name)
}

// management is the broker's management API at http://<host>:15672 as
// the AMQP URL's user (guest on loopback here).
type management struct{ *mgmtapi.Client }

func newManagement(amqpURL *url.URL) *management {
	user, pass := "guest", "guest"
	if amqpURL.User != nil && amqpURL.User.Username() != "" {
		user = amqpURL.User.Username()
		pass, _ = amqpURL.User.Password()
	}
	return &management{mgmtapi.New(url.URL{Scheme: "http", Host: net.JoinHostPort(amqpURL.Hostname(), "15672")}, user, pass, time.Minute)}
}

// up says whether the API answers (the plugin may be off on a broker
// started some other way).
func (m *management) up() bool {
	c, err := net.DialTimeout("tcp", m.Host(), time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

func (m *management) must(tb testing.TB, method, path string, body any) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := m.Do(ctx, method, path, body, nil); err != nil {
		tb.Fatalf("amqptest: management API: %v", err)
	}
}

// String is the vhost's name.
func (v *Vhost) String() string { return fmt.Sprintf("vhost %s", v.Name) }
