package amqp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/redact"
)

// Broker roles: what each fifobox function does on the broker, and so the
// permissions its own user gets (Topology.Permissions). The provisioner
// (the deploy's migrate) alone logs in as the administrator, and creates
// these users.
const (
	// RoleDispatcher publishes to the events exchange: nothing else.
	RoleDispatcher = "dispatcher"
	// RoleConsumer reads its own queue and writes only to its own settle
	// exchange (its retry queues and its DLQ).
	RoleConsumer = "consumer"
	// RoleOperations reads the consumers' DLQs (redrive) and writes to
	// their queues through the default exchange (redrive, replay).
	RoleOperations = "operations"
)

// Permissions are a RabbitMQ user's regular expressions on one vhost: which
// exchanges and queues it may declare or delete (configure), publish to or
// bind to (write, exchanges; the default exchange is "amq.default"), and
// consume, get or bind from (read). "^$" matches nothing.
type Permissions struct {
	Configure string `json:"configure"`
	Write     string `json:"write"`
	Read      string `json:"read"`
}

// nothing is the pattern RabbitMQ matches no name with.
const nothing = "^$"

// anyOf is a pattern matching exactly the given names.
func anyOf(names ...string) string {
	if len(names) == 0 {
		return nothing
	}
	q := make([]string, len(names))
	for i, n := range names {
		q[i] = regexp.QuoteMeta(n)
	}
	return "^(" + strings.Join(q, "|") + ")$"
}

// Permissions returns the permissions of role; consumer names the consumer
// for RoleConsumer. Nobody but the provisioner may configure: no function
// can declare, delete or purge a queue or exchange.
func (t *Topology) Permissions(role, consumer string) (Permissions, error) {
	switch role {
	case RoleDispatcher:
		return Permissions{Configure: nothing, Write: anyOf(t.Exchange.Name), Read: nothing}, nil
	case RoleConsumer:
		c, ok := t.Consumer(consumer)
		if !ok {
			return Permissions{}, fmt.Errorf("broker permissions: consumer %q is not in the topology", consumer)
		}
		return Permissions{Configure: nothing, Write: anyOf(c.SettleExchange()), Read: anyOf(c.QueueName())}, nil
	case RoleOperations:
		dlqs := make([]string, len(t.Consumers))
		for i, c := range t.Consumers {
			dlqs[i] = c.DLQName()
		}
		return Permissions{Configure: nothing, Write: anyOf("amq.default"), Read: anyOf(dlqs...)}, nil
	}
	return Permissions{}, fmt.Errorf("broker permissions: role %q: must be %s, %s or %s", role, RoleDispatcher, RoleConsumer, RoleOperations)
}

// User is a function's broker user for the provisioner to create or update.
type User struct {
	// Name and Password log the function in (its Secrets Manager secret).
	Name, Password string
	// Role is RoleDispatcher, RoleConsumer or RoleOperations.
	Role string
	// Consumer names the consumer (RoleConsumer only).
	Consumer string
}

// String names the user and its role, never the password.
func (u User) String() string {
	if u.Role == RoleConsumer {
		return fmt.Sprintf("%s (consumer %s)", u.Name, u.Consumer)
	}
	return fmt.Sprintf("%s (%s)", u.Name, u.Role)
}

// ParseUserKey splits a role key, "dispatcher", "operations" or
// "consumer:<name>", into a role and a consumer name.
func ParseUserKey(key string) (role, consumer string, err error) {
	role, consumer, _ = strings.Cut(key, ":")
	switch {
	case role == RoleConsumer && consumer != "":
	case (role == RoleDispatcher || role == RoleOperations) && consumer == "":
	default:
		return "", "", fmt.Errorf("broker user %q: want dispatcher, operations or consumer:<name>", key)
	}
	return role, consumer, nil
}

// managementURL is the management API's base URL: Config.ManagementURL, or
// derived from the AMQP URL: https://<host> for amqps (Amazon MQ serves it
// on 443), http://<host>:15672 for amqp (a local broker's plugin).
func (c *Config) managementURL() (*url.URL, error) {
	if c.ManagementURL != "" {
		u, err := url.Parse(c.ManagementURL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return nil, fmt.Errorf("ManagementURL %s: want http(s)://host[:port]", redact.URL(c.ManagementURL))
		}
		return u, nil
	}
	a, err := amqp091.ParseURI(c.URL)
	if err != nil {
		return nil, redact.Error(err, c.URL)
	}
	if a.Scheme == "amqps" {
		return &url.URL{Scheme: "https", Host: a.Host}, nil
	}
	return &url.URL{Scheme: "http", Host: net.JoinHostPort(a.Host, "15672")}, nil
}

// ErrManagement is returned (wrapped) when the management API refuses or
// fails a user or permission change.
var ErrManagement = errors.New("amqp: the management API refused the change")

// provisionUsers creates or updates each user (no tags: no management UI,
// no policies) with its password, and sets its permissions on the URL's
// vhost, through the management HTTP API as the URL's (administrator) user.
// Both calls are PUTs: running them again changes nothing but a rotated
// password.
func (p *Provisioner) provisionUsers(ctx context.Context) error {
	base, err := p.cfg.managementURL()
	if err != nil {
		return fmt.Errorf("provision users: %w", err)
	}
	a, err := amqp091.ParseURI(p.cfg.URL)
	if err != nil {
		return fmt.Errorf("provision users: %w", redact.Error(err, p.cfg.URL))
	}
	client := &http.Client{Timeout: 30 * time.Second}
	if p.cfg.TLS != nil {
		client.Transport = &http.Transport{TLSClientConfig: p.cfg.TLS}
	}
	put := func(path string, body any) error {
		b, _ := json.Marshal(body)
		u := *base
		u.RawPath = path
		u.Path, _ = url.PathUnescape(path)
		req, err := http.NewRequestWithContext(ctx, http.MethodPut, u.String(), bytes.NewReader(b))
		if err != nil {
			return err
		}
		req.SetBasicAuth(a.Username, a.Password)
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			return redact.Error(err, p.cfg.URL, a.Password)
		}
		defer resp.Body.Close()
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		if resp.StatusCode/100 != 2 {
			return fmt.Errorf("%w: PUT %s: %s %s", ErrManagement, u.Path, resp.Status, redact.Text(string(msg)))
		}
		return nil
	}
	for _, u := range p.cfg.Users {
		perm, err := p.cfg.Topology.Permissions(u.Role, u.Consumer)
		if err != nil {
			return fmt.Errorf("provision user %s: %w", u, err)
		}
		if u.Name == "" || u.Password == "" || u.Name == a.Username {
			return fmt.Errorf("provision user %s: needs a name (not the administrator's) and a password", u)
		}
		if err := put("/api/users/"+url.PathEscape(u.Name), map[string]string{"password": u.Password, "tags": ""}); err != nil {
			return fmt.Errorf("provision user %s: %w", u, err)
		}
		if err := put("/api/permissions/"+url.PathEscape(a.Vhost)+"/"+url.PathEscape(u.Name), perm); err != nil {
			return fmt.Errorf("provision permissions of %s on vhost %s: %w", u, a.Vhost, err)
		}
		p.cfg.Logger.Info("amqp: broker user provisioned", "user", u.Name, "role", u.Role, "consumer", u.Consumer, "vhost", a.Vhost,
			"configure", perm.Configure, "write", perm.Write, "read", perm.Read)
	}
	return nil
}
