package amqp

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"sort"
	"time"

	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/redact"
	"github.com/fifobox/fifobox/pkg/transport"
)

// EnvSecretARN names the Secrets Manager secret holding the broker user's
// credentials: on AWS the functions read them at init, so no password sits
// in a function's configuration.
const EnvSecretARN = "FIFOBOX_AMQP_SECRET_ARN"

// OpenEnv is every variable transport.Open reads for RabbitMQ: Env, the
// wire profile's (ProfileEnv) and the secret's ARN.
var OpenEnv = envspec.Join(Env, ProfileEnv, inbox.TableEnv, envspec.Set{
	{Name: EnvSecretARN, Doc: `Secrets Manager secret {"username","password"} for FIFOBOX_AMQP_URL (Amazon MQ: the event source mapping's BASIC_AUTH secret); unset: credentials in the URL`},
	{Name: EnvUserSecrets, Doc: `the provisioner's (migrate's) broker users to create: JSON {"dispatcher"|"operations"|"consumer:<name>": "<secret ARN>"}; unset elsewhere`},
})

// EnvUserSecrets is set on the provisioning (migration) function only: the
// functions' own broker users, which migrate creates on the broker with
// their roles' permissions, as JSON {"dispatcher": "<secret ARN>",
// "operations": "<ARN>", "consumer:<name>": "<ARN>", ...}; each secret holds
// {"username","password"}.
const EnvUserSecrets = "FIFOBOX_AMQP_USER_SECRETS"

func init() {
	transport.Register(transport.RabbitMQ, transport.Opener{Env: OpenEnv, Open: open})
}

// secretTimeout bounds reading the secret (inside a Lambda's 10 s init).
const secretTimeout = 7 * time.Second

func open(ctx context.Context, o transport.Options) (transport.Transport, error) {
	cfg, err := ConfigFromEnv()
	if err != nil {
		return nil, err
	}
	cfg.Logger = o.Logger
	if arn := OpenEnv.Get(EnvSecretARN); arn != "" {
		if cfg.URL, err = withSecret(ctx, cfg.URL, arn, o.Secret); err != nil {
			return nil, err
		}
	}
	if raw := OpenEnv.Get(EnvUserSecrets); raw != "" {
		if cfg.Users, err = readUsers(ctx, raw, &cfg.Topology, o.Secret); err != nil {
			return nil, err
		}
	}
	return New(cfg)
}

// readUsers reads the secrets raw (FIFOBOX_AMQP_USER_SECRETS) names into the
// users the provisioner creates. Errors name the variable and the role,
// never a secret's value.
func readUsers(ctx context.Context, raw string, t *Topology, fetch transport.SecretFunc) ([]User, error) {
	if fetch == nil {
		return nil, fmt.Errorf("%s is set, but this program reads no secrets", EnvUserSecrets)
	}
	var arns map[string]string
	if err := json.Unmarshal([]byte(raw), &arns); err != nil {
		return nil, fmt.Errorf("%s: want a JSON object of role to secret ARN: %w", EnvUserSecrets, err)
	}
	keys := make([]string, 0, len(arns))
	for k := range arns {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	ctx, cancel := context.WithTimeout(ctx, secretTimeout)
	defer cancel()
	users := make([]User, 0, len(keys))
	for _, key := range keys {
		role, consumer, err := ParseUserKey(key)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", EnvUserSecrets, err)
		}
		if _, ok := t.Consumer(consumer); role == RoleConsumer && !ok {
			return nil, fmt.Errorf("%s: %s: consumer %q is not in the topology (%s)", EnvUserSecrets, key, consumer, EnvTopology)
		}
		v, err := fetch(ctx, arns[key])
		if err != nil {
			return nil, fmt.Errorf("%s: %s: read secret: %w", EnvUserSecrets, key, err)
		}
		var s struct {
			Username string `json:"username"`
			Password string `json:"password"`
		}
		if err := json.Unmarshal([]byte(v), &s); err != nil || s.Username == "" || s.Password == "" {
			return nil, fmt.Errorf("%s: %s: the secret needs username and password", EnvUserSecrets, key)
		}
		users = append(users, User{Name: s.Username, Password: s.Password, Role: role, Consumer: consumer})
	}
	return users, nil
}

// withSecret puts the secret's {"username","password"} into raw, a URL
// without credentials. Errors name the variable and never carry the
// secret's value.
func withSecret(ctx context.Context, raw, arn string, fetch transport.SecretFunc) (string, error) {
	u, err := url.Parse(raw)
	switch {
	case err != nil:
		return "", fmt.Errorf("%s: %w", EnvURL, redact.Error(err, raw))
	case u.User != nil:
		return "", fmt.Errorf("%s and credentials in %s: set one or the other", EnvSecretARN, EnvURL)
	case fetch == nil:
		return "", fmt.Errorf("%s is set, but this program reads no secrets: put the credentials in %s", EnvSecretARN, EnvURL)
	}
	ctx, cancel := context.WithTimeout(ctx, secretTimeout)
	defer cancel()
	v, err := fetch(ctx, arn)
	if err != nil {
		return "", fmt.Errorf("%s: read secret: %w", EnvSecretARN, err)
	}
	var s struct {
		Username string `json:"username"`
		Password string `json:"password"`
	}
	if err := json.Unmarshal([]byte(v), &s); err != nil {
		return "", fmt.Errorf("%s: secret is not a JSON object", EnvSecretARN)
	}
	if s.Username == "" || s.Password == "" {
		return "", fmt.Errorf("%s: secret needs username and password", EnvSecretARN)
	}
	u.User = url.UserPassword(s.Username, s.Password)
	return u.String(), nil
}
