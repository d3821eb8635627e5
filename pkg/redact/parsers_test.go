package redact_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fifobox/fifobox/pkg/db"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	natsbus "github.com/fifobox/fifobox/pkg/transport/nats"
)

// The password every case hides: "%zz" is no valid percent escape, so Go's
// url.Parse fails on it and quotes its input in the error.
const password = "S3cr%zzet"

// leaked is every form of the password a message could carry.
func leaked(s string) bool {
	return strings.Contains(s, "S3cr") || strings.Contains(s, "zzet")
}

// logBuffer is a JSON logger's output, safe for the connectors' goroutines.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// check fails the test if err (which must be non-nil) or the log carries the password.
func check(t *testing.T, what string, err error, logs *logBuffer) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: no error for a malformed or unreachable value", what)
	}
	if leaked(err.Error()) {
		t.Errorf("%s: the error carries the password: %v", what, err)
	}
	if logs != nil && leaked(logs.String()) {
		t.Errorf("%s: a log line carries the password:\n%s", what, logs)
	}
}

func msgs() []outbox.Message {
	return []outbox.Message{{EventID: "e1", EventType: "order.placed", AggregateType: "order", GroupID: "o1", Sequence: 1, Body: []byte(`{}`)}}
}

// TestNoParserEchoesAPassword feeds every path that parses or formats a
// URL or DSN a value holding a password, malformed or unreachable, and
// looks for the password in the error and in every log line.
func TestNoParserEchoesAPassword(t *testing.T) {
	badAMQP := "amqps://fifobox:" + password + "@b-1.mq.us-east-1.amazonaws.com:5671/vh"
	badNATS := "nats://fifobox:" + password + "@127.0.0.1:4222"
	badPG := "postgres://fifobox:" + password + "@127.0.0.1:5432/fifobox"
	badPGKV := "host=127.0.0.1 user=fifobox password=" + password + " port=notaport"

	t.Run("amqp config", func(t *testing.T) {
		_, err := amqp.NewPublisher(amqp.Config{URL: badAMQP, Topology: amqp.Holdco()})
		check(t, "amqp.NewPublisher", err, nil)
		t.Setenv(amqp.EnvURL, badAMQP)
		_, err = amqp.ConfigFromEnv()
		check(t, "amqp.ConfigFromEnv", err, nil)
	})
	t.Run("amqp connect", func(t *testing.T) {
		// A valid URL with a (percent-encoded) password, nothing listening.
		logs := &logBuffer{}
		p, err := amqp.NewPublisher(amqp.Config{URL: "amqp://fifobox:S3cr%25zzet@127.0.0.1:1/vh", Topology: amqp.Holdco(),
			ConnectWait: 200 * time.Millisecond, DialTimeout: time.Second, Logger: slog.New(slog.NewJSONHandler(logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		check(t, "amqp publish", p.Publish(context.Background(), msgs())[0], logs)
	})
	t.Run("nats config", func(t *testing.T) {
		_, err := natsbus.NewPublisher(natsbus.Config{URL: badNATS, Topology: natsbus.Ticketing()})
		check(t, "nats.NewPublisher", err, nil)
		_, err = natsbus.NewPublisher(natsbus.Config{URL: "nats://127.0.0.1:4222," + badNATS, Topology: natsbus.Ticketing()})
		check(t, "nats.NewPublisher (second of two URLs)", err, nil)
		t.Setenv(natsbus.EnvURL, badNATS)
		_, err = natsbus.ConfigFromEnv()
		check(t, "nats.ConfigFromEnv", err, nil)
	})
	t.Run("nats connect", func(t *testing.T) {
		logs := &logBuffer{}
		p, err := natsbus.NewPublisher(natsbus.Config{URL: "nats://fifobox:S3cr%25zzet@127.0.0.1:1", Topology: natsbus.Ticketing(),
			ConnectWait: 200 * time.Millisecond, DialTimeout: time.Second, Logger: slog.New(slog.NewJSONHandler(logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		check(t, "nats publish", p.Publish(context.Background(), msgs())[0], logs)
		p2, err := natsbus.NewPublisher(natsbus.Config{URL: "nats://127.0.0.1:1", User: "fifobox", Password: password, Topology: natsbus.Ticketing(),
			ConnectWait: 200 * time.Millisecond, DialTimeout: time.Second, Logger: slog.New(slog.NewJSONHandler(logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		defer p2.Close()
		check(t, "nats publish (user and password)", p2.Publish(context.Background(), msgs())[0], logs)
	})
	t.Run("database", func(t *testing.T) {
		for _, dsn := range []string{badPG, badPGKV, "postgres://fifobox:" + password + "@127.0.0.1:99999/fifobox"} {
			check(t, "db.Config.Validate", db.Config{URL: dsn}.Validate(), nil)
			_, err := db.PoolConfig(db.Config{URL: dsn}, nil, nil)
			check(t, "db.PoolConfig", err, nil)
			t.Setenv("FIFOBOX_DATABASE_URL", dsn)
			_, err = db.FromEnv()
			if err == nil {
				_, err = db.Open(context.Background(), db.Config{URL: dsn}, nil)
			}
			check(t, "db.FromEnv / db.Open", err, nil)
		}
	})
	t.Run("transport.Open (the functions' settings)", func(t *testing.T) {
		clearTransportEnv(t)
		t.Setenv("FIFOBOX_TRANSPORT", "rabbitmq")
		t.Setenv(amqp.EnvURL, badAMQP)
		_, err := transport.Open(context.Background(), transport.Options{})
		check(t, "transport.Open (rabbitmq)", err, nil)
		clearTransportEnv(t)
		t.Setenv("FIFOBOX_TRANSPORT", "nats")
		t.Setenv(natsbus.EnvURL, badNATS)
		_, err = transport.Open(context.Background(), transport.Options{})
		check(t, "transport.Open (nats)", err, nil)
	})
	t.Run("secrets manager URL", func(t *testing.T) {
		// The URL a function builds from its secret: a password with
		// reserved characters, then a connection that fails.
		clearTransportEnv(t)
		t.Setenv("FIFOBOX_TRANSPORT", "rabbitmq")
		t.Setenv(amqp.EnvURL, "amqp://127.0.0.1:1/vh")
		t.Setenv(amqp.EnvSecretARN, "arn:aws:secretsmanager:eu-west-1:1:secret:x")
		fetch := func(context.Context, string) (string, error) {
			return `{"username":"fifobox","password":"` + password + `/@:"}`, nil
		}
		logs := &logBuffer{}
		tr, err := transport.Open(context.Background(), transport.Options{Secret: fetch, Logger: slog.New(slog.NewJSONHandler(logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		defer tr.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		pub, err := tr.Publisher()
		if err != nil {
			t.Fatal(err)
		}
		check(t, "publish with the secret's credentials", pub.Publish(ctx, msgs())[0], logs)
		if leaked(tr.String()) {
			t.Errorf("the transport's description carries the password: %s", tr)
		}
	})
}

// clearTransportEnv unsets every variable transport.Open may read.
func clearTransportEnv(t *testing.T) {
	t.Helper()
	for _, v := range transport.RegisteredEnv() {
		t.Setenv(v.Name, "")
	}
}
